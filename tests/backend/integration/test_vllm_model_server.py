"""`vllm_model` (Triton's vLLM backend contract, served by llm_engine through BLS) on the real server.

vllm_backend's `samples/client.py` request shape over gRPC (text_input [1], stream [1],
sampling_parameters [1] JSON with string values, exclude_input_in_output [1], the same JSON as gRPC
parameters, request ids echoed), the README's generate-endpoint curl, generate_stream, n = 2,
refusals naming the key, cancellation, and the page pool idle after.
"""
from __future__ import annotations

import json
import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from server_helpers import pool_gauges, post, wait_for_idle_pool

pytestmark = pytest.mark.server

MODEL = "vllm_model"
PROMPT = "What is Triton Inference Server?"
# samples/client.py sends prompt-file lines with their "\n". SmolLM2-135M's greedy answer to PROMPT
# without it is EOS at once (llm_bls too), so the generation tests keep the newline.
LINE = PROMPT + "\n"
SAMPLE_PARAMS = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}


# -- gRPC, as samples/client.py ------------------------------------------------------------------------
def client_inputs(prompt: str, stream: bool, sampling: dict, exclude: bool, **flags: bool):
    def tensor(name, arr, dtype):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t
    inputs = [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
              tensor("stream", np.array([stream], dtype=bool), "BOOL"),
              tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
              tensor("exclude_input_in_output", np.array([exclude], dtype=bool), "BOOL")]
    inputs += [tensor(name, np.array([v], dtype=bool), "BOOL") for name, v in flags.items()]
    return inputs


def stream_requests(url: str, requests: list[dict], timeout: float = 300.0, cancel_after: int | None = None):
    """Sends every request over one stream_infer stream (as samples/client.py); returns
    {request_id: [(response as dict, is_final)]} and {request_id: error}. cancel_after: stop the stream
    with cancel_requests=True after that many responses."""
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for i, r in enumerate(requests):
        client.async_stream_infer(MODEL, client_inputs(r["prompt"], r["stream"], r["sampling"], r["exclude"],
                                                       **r.get("flags", {})),
                                  outputs=[grpcclient.InferRequestedOutput("text_output")] if r.get("only_text", True)
                                  else None,
                                  request_id=str(i), parameters=r["sampling"])
    got: dict[str, list] = {str(i): [] for i in range(len(requests))}
    errors: dict[str, str] = {}
    done: set[str] = set()
    seen = 0
    try:
        while len(done) < len(requests):
            result, error = results.get(timeout=timeout)
            if error is not None:
                # the error's request id is not exposed by tritonclient: one request per such test
                errors[str(len(errors))] = str(error)
                done.add(f"error-{len(errors)}")
                continue
            resp = result.get_response()
            final = resp.parameters["triton_final_response"].bool_param
            outputs = {o.name: result.as_numpy(o.name) for o in resp.outputs}
            got[resp.id].append((outputs, final))
            seen += 1
            if final:
                done.add(resp.id)
            if cancel_after is not None and seen >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return got, errors
    finally:
        client.stop_stream()
        client.close()
    return got, errors


def texts(responses) -> str:
    return "".join(b"".join(out["text_output"].tolist()).decode() for out, _ in responses)


@pytest.fixture(scope="module")
def server(triton_server):
    yield triton_server
    wait_for_idle_pool(triton_server.metrics_url)


def test_sample_client_non_streaming_echoes_the_prompt(server):
    prompts = [LINE, "The capital of France is\n"]
    got, errors = stream_requests(server.grpc_url, [
        {"prompt": p, "stream": False, "sampling": SAMPLE_PARAMS, "exclude": False} for p in prompts])
    assert not errors
    for i, p in enumerate(prompts):
        (out, final), = got[str(i)]                   # one response per request, carrying the final flag
        assert final and out["text_output"].dtype == np.object_ and out["text_output"].shape == (1,)
        text = texts(got[str(i)])
        assert text.startswith(p) and len(text) > len(p), text


def test_sample_client_streaming_sends_deltas_and_the_final_flag_on_the_last(server):
    got, errors = stream_requests(server.grpc_url, [
        {"prompt": LINE, "stream": True, "sampling": SAMPLE_PARAMS, "exclude": True}])
    assert not errors
    responses = got["0"]
    assert len(responses) > 1 and [f for _, f in responses] == [False] * (len(responses) - 1) + [True]
    assert all("text_output" in out for out, _ in responses)     # the final response carries data
    assert not texts(responses).startswith(LINE) and texts(responses).strip()


def test_streaming_with_the_prompt_echoed_is_refused(server):
    got, errors = stream_requests(server.grpc_url, [
        {"prompt": PROMPT, "stream": True, "sampling": SAMPLE_PARAMS, "exclude": False}])
    assert "When streaming, `exclude_input_in_output` = False is not allowed." in errors["0"], errors


def test_streamed_greedy_deltas_join_to_the_non_streamed_text(server):
    greedy = {"temperature": "0", "max_tokens": "24"}
    got, errors = stream_requests(server.grpc_url, [
        {"prompt": LINE, "stream": True, "sampling": greedy, "exclude": True},
        {"prompt": LINE, "stream": False, "sampling": greedy, "exclude": True},
        {"prompt": LINE, "stream": False, "sampling": greedy, "exclude": False}])
    assert not errors
    assert texts(got["0"]) == texts(got["1"]) and texts(got["2"]) == LINE + texts(got["1"])


def test_every_additional_output(server, tokenizer):
    flags = dict(return_finish_reason=True, return_cumulative_logprob=True, return_logprobs=True,
                 return_num_input_tokens=True, return_num_output_tokens=True)
    got, errors = stream_requests(server.grpc_url, [
        {"prompt": LINE, "stream": True, "sampling": {"temperature": 0, "max_tokens": 6, "logprobs": 0,
                                                         "ignore_eos": True},
         "exclude": True, "flags": flags, "only_text": False}])
    assert not errors
    responses = [out for out, _ in got["0"]]
    assert [r["finish_reason"].tolist() for r in responses] == [[b"None"]] * (len(responses) - 1) + [[b"length"]]
    assert sum(int(r["num_output_tokens"][0]) for r in responses) == 6
    assert all(r["num_input_tokens"].dtype == np.uint32 and r["num_input_tokens"].tolist() == [len(tokenizer.encode(LINE))]
               for r in responses)
    entries = [e for r in responses for e in json.loads(r["logprobs"][0])]
    assert len(entries) == 6 and all(len(e) == 1 for e in entries)
    logprobs = [v["logprob"] for e in entries for v in e.values()]
    assert all(lp <= 0 for lp in logprobs)
    assert "".join(v["decoded_token"] for e in entries for v in e.values()) == texts(got["0"])
    cum = responses[-1]["cumulative_logprob"]
    assert cum.dtype == np.float32 and cum[0] == pytest.approx(sum(logprobs), abs=1e-3)


LONG = {"max_tokens": "2000", "ignore_eos": "true"}     # far longer than the 10 s the pool is given


@pytest.mark.parametrize("n", [1, 2])
def test_a_cancelled_stream_frees_its_pages(server, n):
    got, _ = stream_requests(server.grpc_url, [
        {"prompt": LINE, "stream": True, "sampling": {**LONG, "n": str(n)}, "exclude": True}], cancel_after=2)
    assert len(got["0"]) >= 2
    wait_for_idle_pool(server.metrics_url, timeout_s=10)


def test_a_cancelled_non_streamed_request_frees_its_pages(server):
    """No response comes before the end: vllm_model's watcher sees the cancel and tells llm_engine."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    client.async_stream_infer(MODEL, client_inputs(LINE, False, LONG, True), request_id="c")
    deadline = time.monotonic() + 30
    while pool_gauges(server.metrics_url)["kvshare_requests_running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.1)
    client.stop_stream(cancel_requests=True)
    client.close()
    wait_for_idle_pool(server.metrics_url, timeout_s=10)


# -- HTTP: the generate extension ----------------------------------------------------------------------


def generate(server, body: dict) -> dict:
    status, ctype, text = post(f"{server.http_url}/v2/models/{MODEL}/generate", body)
    assert status == 200 and ctype.startswith("application/json"), (status, text)
    return json.loads(text)


def generate_stream(server, body: dict) -> list[dict]:
    status, ctype, text = post(f"{server.http_url}/v2/models/{MODEL}/generate_stream", body)
    assert status == 200 and ctype.startswith("text/event-stream"), (status, text)
    events = [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e]
    assert events and not [e for e in events if "error" in e], events
    return events


def test_readme_curl(server):
    out = generate(server, {"text_input": PROMPT, "parameters": {"stream": False, "temperature": 0}})
    assert out["model_name"] == MODEL and out["model_version"] == "1"
    assert out["text_output"].startswith(PROMPT), out          # vLLM echoes the prompt when not streaming
    out = generate(server, {"text_input": LINE, "parameters": {"stream": False, "temperature": 0}})
    assert out["text_output"].startswith(LINE) and out["text_output"][len(LINE):].strip(), out


def test_generate_stream(server):
    body = {"text_input": LINE, "parameters": {"stream": True, "temperature": 0, "max_tokens": 12,
                                                 "return_finish_reason": True, "return_num_output_tokens": True}}
    events = generate_stream(server, body)
    assert len(events) > 1 and all(e["model_name"] == MODEL for e in events)
    assert [e["finish_reason"] for e in events[:-1]] == ["None"] * (len(events) - 1)
    assert events[-1]["finish_reason"] in ("stop", "length")
    whole = generate(server, {"text_input": LINE, "exclude_input_in_output": True,
                              "parameters": {"temperature": 0, "max_tokens": 12}})
    assert "".join(e["text_output"] for e in events) == whole["text_output"]


def test_n_2_non_streamed_and_streamed(server):
    params = {"n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 8, "ignore_eos": True,
              "return_num_output_tokens": True, "return_finish_reason": True}
    out = generate(server, {"text_input": LINE, "parameters": params})
    assert len(out["text_output"]) == 2 and all(t.startswith(LINE) for t in out["text_output"]), out
    assert out["num_output_tokens"] == [8, 8] and out["finish_reason"] == ["length", "length"]
    events = generate_stream(server, {"text_input": LINE, "parameters": {**params, "stream": True}})
    assert all(len(e["text_output"]) == 2 for e in events)
    assert [sum(e["num_output_tokens"][i] for e in events) for i in (0, 1)] == [8, 8]
    # each streamed response is one sequence's delta: the other sequence's element is ""
    assert all(min(e["num_output_tokens"]) == 0 for e in events)
    assert events[-1]["finish_reason"] == ["length", "length"]


def test_an_unknown_sampling_key_is_refused_by_name(server):
    status, _, text = post(f"{server.http_url}/v2/models/{MODEL}/generate",
                           {"text_input": PROMPT, "parameters": {"temperature": 0, "bogus_key": 1}})
    assert status == 400 and "parameters.bogus_key" in text, (status, text)
    got, errors = stream_requests(server.grpc_url, [
        {"prompt": PROMPT, "stream": False, "sampling": {**SAMPLE_PARAMS, "bogus_key": "1"}, "exclude": False}])
    assert "sampling_parameters.bogus_key" in errors["0"], errors
    status, _, text = post(f"{server.http_url}/v2/models/{MODEL}/generate",
                           {"text_input": PROMPT, "parameters": {"max_tokens": 100000}})
    assert status == 400 and "parameters.max_tokens" in text, (status, text)


def test_the_pool_is_idle_after(server):
    g = wait_for_idle_pool(server.metrics_url)
    assert g["kvshare_kv_pages_free"] + g["kvshare_kv_pages_cached"] == g["kvshare_kv_pages_total"]
