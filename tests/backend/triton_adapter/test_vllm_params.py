"""vLLM's sampling_parameters JSON (Triton's vLLM backend contract) to SamplingParams."""
from __future__ import annotations

import json

import pytest

from kvshare.engine.outputs import InvalidRequest
from kvshare.triton_adapter.vllm_params import KEY_DOCS, parse_request_parameters, parse_sampling_parameters


def parse(d, **kw):
    return parse_sampling_parameters(json.dumps(d) if not isinstance(d, str) else d, default_max_tokens=16, **kw)


def test_defaults():
    params, n, extras = parse({})
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, n) == (16, 1.0, 1.0, 0, 1)
    assert params.logprobs == -1 and extras.stop_token_ids == () and extras.logprobs is None
    assert parse("")[0].max_tokens == 16


def test_string_values_are_cast_by_the_keys_type():
    # vLLM's samples/client.py and genai-perf send strings
    params, n, _ = parse({"temperature": "0.1", "top_p": "0.95", "max_tokens": "100", "min_tokens": "5", "n": "2",
                          "ignore_eos": "false", "seed": "18446744073709551615", "top_k": "-1"})
    assert (params.temperature, params.top_p, params.max_tokens, params.min_tokens, n) == (0.1, 0.95, 100, 5, 2)
    assert params.ignore_eos is False and params.seed == 2 ** 64 - 1 and params.top_k == 0
    assert parse({"ignore_eos": "true"})[0].ignore_eos is True
    assert parse({"ignore_eos": "True", "max_tokens": 10.0})[0].max_tokens == 10


def test_every_supported_key():
    params, n, extras = parse({
        "n": 3, "best_of": 3, "temperature": 0, "top_p": 0.5, "top_k": 40, "min_p": 0, "seed": 1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "stop": "\n",
        "stop_token_ids": [7, "8"], "bad_words": ["x", ""], "ignore_eos": True, "max_tokens": 9, "min_tokens": 1,
        "logprobs": 2, "logit_bias": {"5": -100, "6": 2.5}, "skip_special_tokens": True,
        "include_stop_str_in_output": False, "detokenize": True, "spaces_between_special_tokens": True,
        "prompt_logprobs": None, "structured_outputs": None, "lora_name": None, "use_beam_search": False})
    assert n == 3 and params.temperature == 0.0 and params.top_p == 0.5 and params.top_k == 40 and params.seed == 1
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.1)
    assert params.stop == ("\n",) and params.ignore_eos and params.max_tokens == 9 and params.min_tokens == 1
    assert params.logprobs == 2 and params.logit_bias == ((5, -100.0), (6, 2.5))
    assert extras.stop_token_ids == (7, 8) and extras.bad_words == ("x",) and extras.logprobs == 2
    assert parse({"stop": ["a", "", "b"]})[0].stop == ("a", "b")
    assert parse({"logprobs": 0})[0].logprobs == 0


def test_null_means_unset():
    params, n, _ = parse({"max_tokens": None, "seed": None, "temperature": None, "n": None, "stop": None})
    assert (params.max_tokens, params.seed, params.temperature, n, params.stop) == (16, None, 1.0, 1, ())


@pytest.mark.parametrize("d,key", [
    ({"bogus": 1}, "bogus"), ({"max_tokens": "many"}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 0.1}, "min_p"), ({"n": 0}, "n"), ({"n": 9}, "n"),
    ({"best_of": 3, "n": 2}, "best_of"), ({"ignore_eos": "maybe"}, "ignore_eos"), ({"ignore_eos": 2}, "ignore_eos"),
    ({"stop": 5}, "stop"), ({"stop": ["a", 1]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"), ({"bad_words": "x"}, "bad_words"), ({"logprobs": -1}, "logprobs"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"logit_bias": {"3": "big"}}, "logit_bias.3"), ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"include_stop_str_in_output": "true"}, "include_stop_str_in_output"), ({"detokenize": False}, "detokenize"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"), ({"structured_outputs": "{}"}, "structured_outputs"),
    ({"guided_decoding": {"json": {}}}, "guided_decoding"), ({"lora_name": "x"}, "lora_name"),
    ({"use_beam_search": True}, "use_beam_search"), ({"seed": -1}, "seed"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"min_tokens": -1}, "min_tokens"), ({"temperature": True}, "temperature"),
])
def test_bad_keys_and_values_are_named(d, key):
    with pytest.raises(InvalidRequest) as err:
        parse(d)
    assert err.value.field == f"sampling_parameters.{key}", str(err.value)


@pytest.mark.parametrize("raw", ["{", "[1]", b"\xff"])
def test_not_a_json_object(raw):
    with pytest.raises(InvalidRequest, match="^sampling_parameters"):
        parse_sampling_parameters(raw, default_max_tokens=16)


def test_request_parameters_fallback():
    # vllm_backend README: {"text_input": ..., "parameters": {"stream": false, "temperature": 0}}
    params, n, extras = parse_request_parameters(
        {"temperature": 0, "max_tokens": 5, "id": "42", "triton_enable_empty_final_response": True,
         "stream": "false", "exclude_input_in_output": True}, default_max_tokens=16)
    assert params.temperature == 0.0 and params.max_tokens == 5 and n == 1
    assert dict(extras.inputs) == {"stream": False, "exclude_input_in_output": True}
    with pytest.raises(InvalidRequest) as err:
        parse_request_parameters(json.dumps({"frobnicate": 1}), default_max_tokens=16)
    assert err.value.field == "parameters.frobnicate"
    # in the tensor, the model's input names are not sampling parameters
    with pytest.raises(InvalidRequest, match="^sampling_parameters.stream"):
        parse({"stream": True})


def test_every_documented_key_parses_with_a_neutral_value():
    neutral = {"n": 1, "best_of": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": 0,
               "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "stop": [], "stop_token_ids": [],
               "bad_words": [], "ignore_eos": False, "max_tokens": 4, "min_tokens": 0, "logprobs": None,
               "logit_bias": {}, "skip_special_tokens": True, "include_stop_str_in_output": False, "detokenize": True,
               "spaces_between_special_tokens": True, "prompt_logprobs": None, "use_beam_search": False,
               "allowed_token_ids": None, "truncate_prompt_tokens": None, "structured_outputs": None,
               "guided_decoding": None, "lora_name": None}
    assert set(neutral) == set(KEY_DOCS)
    assert parse(neutral)[0].max_tokens == 4
