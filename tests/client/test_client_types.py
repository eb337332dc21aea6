import dataclasses

import numpy as np
import pytest

from kvshare_client.types import TEXT_MODEL, TOKEN_MODEL, Completion, GenerationRequest, default_model_for


def test_request_needs_exactly_one_prompt_source():
    with pytest.raises(ValueError):
        GenerationRequest()
    with pytest.raises(ValueError):
        GenerationRequest(prompt="a", input_ids=[1])
    assert GenerationRequest(prompt="").is_text  # emptiness is the server's call (it names the field)


def test_request_normalises_sequences_and_is_frozen():
    r = GenerationRequest(input_ids=np.array([1, 2, 3], dtype=np.int64), stop_words="END")
    assert r.input_ids == (1, 2, 3) and all(type(i) is int for i in r.input_ids)
    assert r.stop_words == ("END",)
    assert GenerationRequest(input_ids=[1, 2]) == GenerationRequest(input_ids=(1, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize("bad", [[1, True], [1.5], ["3"]])
def test_request_rejects_non_integer_ids(bad):
    with pytest.raises(TypeError):
        GenerationRequest(input_ids=bad)


def test_request_rejects_non_string_prompt_and_stop_words():
    with pytest.raises(TypeError):
        GenerationRequest(prompt=b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        GenerationRequest(prompt="a", stop_words=["ok", 3])  # type: ignore[list-item]


def test_default_model():
    assert default_model_for(GenerationRequest(prompt="a")) == TEXT_MODEL == "ensemble"
    assert default_model_for(GenerationRequest(input_ids=[1])) == TOKEN_MODEL == "llm_engine"


def completion(**kw):
    base = dict(
        model="ensemble",
        request_id="r",
        text="abc",
        token_ids=(),
        finish_reason="length",
        num_input_tokens=5,
        num_output_tokens=4,
        cached_tokens=2,
        num_responses=5,
        sent_at=10.0,
        finished_at=10.5,
        content_times=(10.1, 10.2, 10.3, 10.4),
        content_tokens=(1, 1, 1, 1),
    )
    base.update(kw)
    return Completion(**base)


def test_completion_timings():
    c = completion()
    assert c.ttft_s == pytest.approx(0.1)
    assert c.e2e_s == pytest.approx(0.5)
    assert c.inter_chunk_s == pytest.approx((0.1, 0.1, 0.1))
    assert c.itl_s == pytest.approx(0.1)  # (10.4 - 10.1) / (4 - 1)
    assert c.tokens_per_s == pytest.approx(8.0)


def test_completion_itl_uses_token_counts_when_responses_carry_several():
    c = completion(num_output_tokens=7, content_times=(10.1, 10.4), content_tokens=(1, 6))
    assert c.itl_s == pytest.approx(0.05)  # 0.3 s over 6 tokens after the first


def test_completion_counts_fall_back_to_ids_then_none():
    assert completion(num_output_tokens=None, token_ids=(1, 2, 3)).output_tokens == 3
    c = completion(num_output_tokens=None, content_times=(), content_tokens=())
    assert c.output_tokens is None and c.tokens_per_s is None and c.ttft_s is None and c.itl_s is None


def test_completion_summary_mentions_what_the_cli_promises():
    s = completion().summary()
    for part in ("tokens=4", "ttft=100.0ms", "tok/s=8.0", "cached_tokens=2", "finish_reason=length"):
        assert part in s
    assert "cancelled" in completion(cancelled=True, finish_reason="cancelled").summary()
