"""A client process killed mid-stream (kill -9: the TCP connection resets, no polite cancel) on each
model of the real server. Where Triton 2.51 turns the broken stream into a cancel (llm_engine,
llm_bls, vllm_model) the request ends and its pages return within about a second; through
`ensemble` it does not reach the running engine step, so the request runs until max_tokens ends it
(the bound, docs/operate/troubleshoot.md) and then its pages return."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from server_helpers import ROOT, pool_gauges, wait_for_idle_pool

pytestmark = pytest.mark.server

PROMPT = "Count from one to one thousand:"

# Streams one long request and prints a line per response, so the test kills it mid-stream.
CLIENT = textwrap.dedent("""
    import json, sys, threading
    import numpy as np
    url, model, max_tokens, ids = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    prompt = "Count from one to one thousand:"
    if model == "vllm_model":
        import tritonclient.grpc as g
        def t(name, arr, dtype):
            x = g.InferInput(name, list(arr.shape), dtype); x.set_data_from_numpy(arr); return x
        c = g.InferenceServerClient(url)
        done = threading.Event()
        def cb(result, error):
            print("error" if error else "response", flush=True)
        c.start_stream(callback=cb)
        sampling = {"max_tokens": str(max_tokens), "ignore_eos": "true", "temperature": "0"}
        c.async_stream_infer(model, [t("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                                     t("stream", np.array([True]), "BOOL"),
                                     t("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES")])
        done.wait()
    else:
        from kvshare_client import GenerationRequest, KvshareClient
        kw = dict(prompt=prompt) if model != "llm_engine" else dict(input_ids=ids)
        with KvshareClient(url, stream_timeout=600) as client:
            for chunk in client.stream(GenerationRequest(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                                                         stream=True, **kw), model=model):
                print("response", flush=True)
""")


def stream_then_kill(url: str, model: str, max_tokens: int, responses: int = 3, ids: list[int] = ()) -> None:
    """Starts the client process, waits for `responses` responses, then kill -9s it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "client"))
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, url, model, str(max_tokens), json.dumps(list(ids))],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(responses):
            line = proc.stdout.readline()
            assert line.strip() == "response", f"the client got {line!r} instead of a response"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


@pytest.fixture(scope="module")
def server(triton_server):
    wait_for_idle_pool(triton_server.metrics_url)
    yield triton_server
    wait_for_idle_pool(triton_server.metrics_url)


@pytest.mark.parametrize("model", ["llm_engine", "llm_bls", "vllm_model"])
def test_a_killed_client_ends_its_request_and_its_pages_return(server, model, tokenizer):
    # 400 tokens take tens of seconds on this CPU: an idle pool within seconds means the request ended
    stream_then_kill(server.grpc_url, model, max_tokens=400, ids=tokenizer.encode(PROMPT))
    killed = time.monotonic()
    wait_for_idle_pool(server.metrics_url, timeout_s=5.0)
    print(f"{model}: pool idle {time.monotonic() - killed:.2f} s after the kill (metrics tick 0.5 s)")


def test_through_the_ensemble_a_killed_client_s_request_runs_to_max_tokens_then_frees_its_pages(server):
    n = 24
    before = pool_gauges(server.metrics_url)
    # the tests before this one may still be publishing their last tokens (the counter trails the
    # gauges by the metrics thread's tick): count from a value that held still for a few ticks
    generated = _settled_generation_tokens(server.metrics_url)
    stream_then_kill(server.grpc_url, "ensemble", max_tokens=n, responses=2)
    wait_for_idle_pool(server.metrics_url, timeout_s=60.0)
    # every one of the n tokens was generated: the cancel never reached the engine. The counters are
    # published by the metrics thread after the engine's tick, so they may trail the pool gauges.
    deadline = time.monotonic() + 30.0
    while _generation_tokens(server.metrics_url) - generated < n and time.monotonic() < deadline:
        time.sleep(0.25)
    assert _generation_tokens(server.metrics_url) - generated == n
    after = pool_gauges(server.metrics_url)
    assert after["kvshare_kv_pages_total"] == before["kvshare_kv_pages_total"]


def _settled_generation_tokens(metrics_url: str, ticks: int = 3, tick_s: float = 0.6, timeout_s: float = 30.0) -> float:
    """kvshare_generation_tokens_total once it read the same for `ticks` reads `tick_s` apart."""
    deadline = time.monotonic() + timeout_s
    value, same = _generation_tokens(metrics_url), 0
    while same < ticks and time.monotonic() < deadline:
        time.sleep(tick_s)
        now = _generation_tokens(metrics_url)
        same, value = (same + 1, value) if now == value else (0, now)
    return value


def _generation_tokens(metrics_url: str) -> float:
    from kvshare_client.metrics import fetch_metrics, metric_total, parse_samples

    return metric_total(parse_samples(fetch_metrics(metrics_url)), "kvshare_generation_tokens_total")
