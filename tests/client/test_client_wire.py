import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import InferInput

from kvshare_client.types import GenerationRequest
from kvshare_client.wire import EMPTY_FINAL_PARAM, build_tensors, to_infer_inputs, to_model_infer_request

ALL_SET = GenerationRequest(
    prompt="héllo 世界 🙂",
    max_tokens=16,
    temperature=0.5,
    top_p=0.9,
    top_k=40,
    min_tokens=2,
    seed=2**63 + 5,
    stop_words=["</s>", "。"],
    repetition_penalty=1.1,
    presence_penalty=0.2,
    frequency_penalty=0.3,
    stream=True,
    exclude_input_in_output=False,
    cache_salt="tenant-a",
    apply_chat_template=True,
    return_num_input_tokens=True,
    return_num_output_tokens=False,
    ignore_eos=True,
)

EXPECTED = {  # name -> (Triton datatype, numpy dtype) of the wire contract
    "text_input": ("BYTES", np.object_),
    "max_tokens": ("INT32", np.int32),
    "top_k": ("INT32", np.int32),
    "min_tokens": ("INT32", np.int32),
    "seed": ("UINT64", np.uint64),
    "temperature": ("FP32", np.float32),
    "top_p": ("FP32", np.float32),
    "repetition_penalty": ("FP32", np.float32),
    "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32),
    "stream": ("BOOL", np.bool_),
    "exclude_input_in_output": ("BOOL", np.bool_),
    "return_num_input_tokens": ("BOOL", np.bool_),
    "return_num_output_tokens": ("BOOL", np.bool_),
    "apply_chat_template": ("BOOL", np.bool_),
    "ignore_eos": ("BOOL", np.bool_),
    "cache_salt": ("BYTES", np.object_),
    "stop_words": ("BYTES", np.object_),
}


def by_name(request):
    return {t.name: t for t in build_tensors(request)}


def test_only_the_prompt_is_sent_when_nothing_else_is_set():
    assert list(by_name(GenerationRequest(prompt="hi"))) == ["text_input"]
    assert list(by_name(GenerationRequest(input_ids=[1, 2]))) == ["input_ids"]


def test_each_set_field_adds_exactly_its_input():
    assert set(by_name(GenerationRequest(prompt="hi", max_tokens=3))) == {"text_input", "max_tokens"}
    # False is a value the user set, not "unset": it must travel.
    assert set(by_name(GenerationRequest(prompt="hi", stream=False))) == {"text_input", "stream"}
    assert set(by_name(GenerationRequest(prompt="hi", temperature=0))) == {"text_input", "temperature"}


def test_all_fields_dtypes_and_scalar_shapes():
    tensors = by_name(ALL_SET)
    assert set(tensors) == set(EXPECTED)
    for name, (datatype, dtype) in EXPECTED.items():
        t = tensors[name]
        assert t.datatype == datatype, name
        assert t.array.dtype == dtype, name
        assert t.shape == ((1, 2) if name == "stop_words" else (1, 1)), name
    assert tensors["seed"].array[0, 0] == 2**63 + 5
    assert tensors["stream"].array[0, 0] and not tensors["exclude_input_in_output"].array[0, 0]
    assert tensors["return_num_output_tokens"].array[0, 0] == False  # noqa: E712


def test_token_ids_are_int32_with_batch_dim():
    t = by_name(GenerationRequest(input_ids=[5, 6, 7], max_tokens=2))["input_ids"]
    assert (t.datatype, t.shape, t.array.dtype) == ("INT32", (1, 3), np.int32)
    assert t.raw_bytes() == struct.pack("<3i", 5, 6, 7)


def test_bytes_encoding_is_length_prefixed_utf8():
    t = by_name(ALL_SET)["stop_words"]
    assert t.raw_bytes() == struct.pack("<I", 4) + b"</s>" + struct.pack("<I", 3) + "。".encode()
    prompt = by_name(ALL_SET)["text_input"]
    encoded = "héllo 世界 🙂".encode("utf-8")
    assert prompt.raw_bytes() == struct.pack("<I", len(encoded)) + encoded


def test_raw_bytes_match_what_tritonclient_sends():
    for t, inp in zip(build_tensors(ALL_SET), to_infer_inputs(build_tensors(ALL_SET))):
        assert isinstance(inp, InferInput)
        assert (inp.name(), inp.datatype(), list(inp.shape())) == (t.name, t.datatype, list(t.shape))
        assert inp._get_content() == t.raw_bytes(), t.name


def test_empty_stop_word_list_is_not_sent():
    assert "stop_words" not in by_name(GenerationRequest(prompt="a", stop_words=[]))


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(max_tokens=2**31), ValueError),
        (dict(seed=-1), ValueError),
        (dict(seed=2**64), ValueError),
        (dict(max_tokens=1.5), TypeError),
        (dict(max_tokens=True), TypeError),
        (dict(temperature="hot"), TypeError),
        (dict(stream=1), TypeError),
    ],
)
def test_values_that_cannot_be_encoded_fail_early_naming_the_field(kwargs, error):
    with pytest.raises(error, match=list(kwargs)[0]):
        build_tensors(GenerationRequest(prompt="a", **kwargs))


def test_token_id_outside_int32():
    with pytest.raises(ValueError, match="input_ids"):
        build_tensors(GenerationRequest(input_ids=[2**31]))


def test_hand_built_protobuf_request():
    tensors = build_tensors(ALL_SET)
    req = to_model_infer_request("ensemble", tensors, request_id="abc")
    assert (req.model_name, req.id) == ("ensemble", "abc")
    assert [i.name for i in req.inputs] == [t.name for t in tensors]
    assert [list(i.shape) for i in req.inputs] == [list(t.shape) for t in tensors]
    assert [i.datatype for i in req.inputs] == [t.datatype for t in tensors]
    assert list(req.raw_input_contents) == [t.raw_bytes() for t in tensors]
    assert req.parameters[EMPTY_FINAL_PARAM].bool_param is True


@given(st.text(min_size=0, max_size=50))
def test_any_unicode_prompt_round_trips(prompt):
    raw = by_name(GenerationRequest(prompt=prompt))["text_input"].raw_bytes()
    (n,) = struct.unpack("<I", raw[:4])
    assert raw[4:].decode("utf-8") == prompt and n == len(raw) - 4
