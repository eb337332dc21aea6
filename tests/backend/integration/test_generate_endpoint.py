"""Triton's generate extension (HTTP) with the TensorRT-LLM README's curl bodies, against the real server.

`POST /v2/models/{ensemble,llm_bls}/generate` and `.../generate_stream` over real HTTP (urllib): every
top-level JSON key that names a model input becomes a tensor of the metadata's shape (`"bad_words": ""`
→ a [1,1] BYTES tensor holding "", `["a","b"]` → [1,2]); `/generate` answers one JSON object with every
output tensor by name, `/generate_stream` answers `data: {...}\\n\\n` server-sent events.
(`llm_bls` is kvshare's name for TensorRT-LLM's `tensorrt_llm_bls`.)
"""
from __future__ import annotations

import json

import pytest

from server_helpers import post, wait_for_idle_pool

pytestmark = pytest.mark.server

MODELS = ["ensemble", "llm_bls"]
README = {"text_input": "What is machine learning?", "max_tokens": 20, "bad_words": "", "stop_words": ""}
WITH_IDS = {**README, "pad_id": 2, "end_id": 2}
WITH_WORDS = {**README, "bad_words": ["intelligence", "model"], "stop_words": ["focuses", "learn"],
              "pad_id": 2, "end_id": 2}
GEMMA = {**README, "bad_words": [" intelligence", " allows"], "stop_words": [" computers", "learn"]}




def generate(base: str, model: str, body: dict) -> dict:
    status, ctype, text = post(f"{base}/v2/models/{model}/generate", body)
    assert status == 200, (body, status, text)
    assert ctype.startswith("application/json"), ctype
    return json.loads(text)


def generate_stream(base: str, model: str, body: dict) -> list[dict]:
    status, ctype, text = post(f"{base}/v2/models/{model}/generate_stream", body)
    assert status == 200, (body, status, text)
    assert ctype.startswith("text/event-stream"), ctype
    assert text.endswith("\n\n"), text[-200:]
    events = [e for e in text.split("\n\n") if e]
    assert events and all(e.startswith("data: ") for e in events), text[:500]
    out = [json.loads(e[len("data: "):]) for e in events]
    assert not [e for e in out if "error" in e], out
    return out


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.fixture(scope="module")
def base(triton_server):
    yield triton_server.http_url
    wait_for_idle_pool(triton_server.metrics_url)


@pytest.mark.parametrize("model", MODELS)
def test_readme_body(base, model):
    out = generate(base, model, README)
    assert out["model_name"] == model and out["model_version"] == "1"
    # The body sets no sampling input: kvshare samples (temperature 1.0), and may sample EOS first.
    assert isinstance(out["text_output"], str), out
    assert out["finish_reason"] in ("stop", "length"), out
    greedy = generate(base, model, {**README, "temperature": 0})
    assert greedy["text_output"].strip(), greedy
    # kvshare's default is exclude_input_in_output=true (docs/integrate/contract.md): the prompt is not echoed.
    assert not greedy["text_output"].startswith(README["text_input"]), greedy


@pytest.mark.parametrize("model", MODELS)
def test_readme_body_with_pad_and_end_id(base, model, tokenizer):
    assert tokenizer.eos_token_id == 2   # SmolLM2-Instruct's <|im_end|>: end_id 2 is the model's own EOS
    greedy = {**WITH_IDS, "temperature": 0}
    a = generate(base, model, greedy)
    b = generate(base, model, {**README, "temperature": 0})
    assert a["text_output"].strip()
    assert a["text_output"] == b["text_output"]
    assert generate(base, model, WITH_IDS)["text_output"].strip()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("body", [WITH_WORDS, GEMMA], ids=["llama-docs", "gemma-docs"])
def test_readme_body_with_bad_and_stop_words(base, model, body, tokenizer):
    for temperature in (None, 0):   # the README's body as is (server-default sampling), then greedy
        sent = body if temperature is None else {**body, "temperature": temperature}
        out = generate(base, model, sent)
        text = out["text_output"]
        # Stop words are matched on the decoded text and never emitted.
        for stop in body["stop_words"]:
            assert stop not in text, (sent, text)
        # Bad words are token sequences (as TensorRT-LLM tokenizes them: without special tokens).
        if "output_ids" in out:
            ids = out["output_ids"] if isinstance(out["output_ids"], list) else [out["output_ids"]]
            for bad in body["bad_words"]:
                assert not contains(ids, tokenizer.encode(bad, add_special_tokens=False)), (bad, sent, out)
        for bad in body["bad_words"]:
            if bad.startswith(" "):
                assert bad not in text, (sent, text)


@pytest.mark.parametrize("model", MODELS)
def test_generate_stream_events_join_to_the_generate_text(base, model):
    body = {**README, "temperature": 0}
    whole = generate(base, model, body)["text_output"]
    events = generate_stream(base, model, {**body, "stream": True})
    assert len(events) > 1, "stream=true sends one event per text delta"
    assert all(e["model_name"] == model for e in events)
    assert "".join(e["text_output"] for e in events) == whole
    # Without stream=true, generate_stream sends the one whole response as one event.
    [one] = generate_stream(base, model, body)
    assert one["text_output"] == whole


@pytest.mark.parametrize("model", MODELS)
def test_generate_stream_readme_multimodal_style_parameters_object(base, model):
    # The README's generate_stream example puts the sampling inputs under "parameters" (minus the image).
    body = {"id": "42", "text_input": "What is machine learning?",
            "parameters": {"max_tokens": 16, "beam_width": 1, "end_id": 2, "pad_id": 2, "top_k": 1, "top_p": 0,
                           "stream": False, "temperature": 0}}
    [event] = generate_stream(base, model, body)
    assert event["id"] == "42"
    assert event["text_output"].strip()
    reference = generate(base, model, {**README, "max_tokens": 16, "temperature": 0})
    assert event["text_output"] == reference["text_output"]


@pytest.mark.parametrize("model", MODELS)
def test_generate_errors_are_http_errors_naming_the_input(base, model):
    status, _, text = post(f"{base}/v2/models/{model}/generate", {**README, "max_tokens": 0})
    assert status == 400, (status, text)
    assert "max_tokens" in json.loads(text)["error"], text
