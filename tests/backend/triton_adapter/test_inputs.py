"""The wire contract's input parsing: defaults, and an error naming the field for every bad value."""
from __future__ import annotations

import numpy as np
import pytest

from kvshare.engine.outputs import InvalidRequest
from kvshare.triton_adapter.inputs import generation_request, text_input


def getter(**values):
    def get(name):
        v = values.get(name)
        if v is None:
            return None
        return v if isinstance(v, np.ndarray) else np.array([[v]])
    return get


def test_defaults_apply_when_inputs_are_absent():
    req = generation_request(getter(input_ids=np.array([[1, 2, 3]], np.int32)), default_max_tokens=77)
    assert req.prompt_ids == [1, 2, 3]
    assert req.params.max_tokens == 77 and req.params.temperature == 1.0 and req.params.top_p == 1.0
    assert not req.stream and req.exclude_input_in_output and req.cache_salt == ""


def test_every_input_is_read():
    req = generation_request(getter(
        input_ids=np.array([[5, 6]], np.int32), max_tokens=np.array([[9]], np.int32), temperature=np.array([[0.5]], np.float32),
        top_p=np.array([[0.9]], np.float32), top_k=np.array([[40]], np.int32), min_tokens=np.array([[2]], np.int32),
        seed=np.array([[2**63 + 5]], np.uint64), repetition_penalty=np.array([[1.1]], np.float32),
        presence_penalty=np.array([[0.5]], np.float32), frequency_penalty=np.array([[-0.5]], np.float32),
        stop_words=np.array([[b"\n\n", "停".encode()]], dtype=object), stream=np.array([[True]]),
        exclude_input_in_output=np.array([[False]]), return_num_input_tokens=np.array([[True]]),
        return_num_output_tokens=np.array([[True]]), cache_salt=np.array([[b"tenant-a"]], dtype=object),
        ignore_eos=np.array([[True]])), default_max_tokens=1)
    p = req.params
    assert (p.max_tokens, p.top_k, p.min_tokens, p.seed) == (9, 40, 2, 2**63 + 5)
    assert p.temperature == 0.5 and abs(p.top_p - 0.9) < 1e-6 and abs(p.repetition_penalty - 1.1) < 1e-6
    assert p.presence_penalty == 0.5 and p.frequency_penalty == -0.5 and p.ignore_eos
    assert p.stop == ("\n\n", "停")
    assert req.stream and not req.exclude_input_in_output and req.return_num_input_tokens and req.return_num_output_tokens
    assert req.cache_salt == "tenant-a"


@pytest.mark.parametrize("field,value", [
    ("max_tokens", np.array([[0]], np.int32)), ("temperature", np.array([[-1.0]], np.float32)),
    ("temperature", np.array([[np.nan]], np.float32)), ("top_p", np.array([[-0.1]], np.float32)),
    ("top_p", np.array([[1.01]], np.float32)), ("top_k", np.array([[-1]], np.int32)),
    ("min_tokens", np.array([[-2]], np.int32)), ("repetition_penalty", np.array([[0.0]], np.float32)),
    ("frequency_penalty", np.array([[3.0]], np.float32)), ("max_tokens", np.array([[1, 2]], np.int32)),
    ("stop_words", np.array([[1.5]], dtype=np.float32)), ("stop_words", np.array([[b"\xff\xfe"]], dtype=object)),
    ("stop_words", np.zeros((2, 2, 1), dtype=object)), ("cache_salt", np.array([[b"\xc3"]], dtype=object)),
    ("input_ids", np.array([[[1, 2]]], np.int32)), ("input_ids", np.zeros((1, 0), np.int32)),
    ("max_tokens", np.array([[1], [2]], np.int32)), ("input_lengths", np.array([[3]], np.int32)),
])
def test_bad_values_name_their_field(field, value):
    values = {"input_ids": np.array([[1, 2]], np.int32), field: value}
    with pytest.raises(InvalidRequest) as err:
        generation_request(getter(**values), default_max_tokens=8)
    assert err.value.field == field and str(err.value).startswith(field)


@pytest.mark.parametrize("raw", [None, b"", b"   ", b"\xff"])
def test_text_input_errors(raw):
    with pytest.raises(InvalidRequest, match="text_input"):
        text_input(getter(text_input=None if raw is None else np.array([[raw]], dtype=object)))
