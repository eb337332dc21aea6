"""KVSHARE_ENGINE_PROCESS=on through the real Triton server: the engines run in a process of their
own, a child of the llm_engine stub, and the stub keeps the response pump, the probes and Triton's
IPC (engine/engine_process.py). Servers of their own (only llm_engine, dummy weights); the streams
are the same tokens as an engine in this process; a client that hangs up frees its pages; SIGTERM
under load ends every request with a final; a killed engine process ends its requests with an
error naming it, later requests fail at once with the same, and an unload + load serves again."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_helpers import own_server, pool_gauges, wait_for_idle_pool
from test_shutdown_and_stub_kill_server import LONG, Streams, _repository

from kvshare_client import GenerationRequest, KvshareClient
from kvshare_client.errors import KvshareClientError

pytestmark = pytest.mark.server

ENV = {"KVSHARE_MODEL": "dummy:tiny-llama", "KVSHARE_DEBUG_CHECKS": "true", "KVSHARE_ENGINE_PROCESS": "on",
       "KVSHARE_FAULTS": "slow_step:20ms"}
PROMPTS = [[5, 6, 7 + i, 40 + 3 * i] for i in range(4)]
GREEDY = dict(max_tokens=12, min_tokens=12, temperature=0.0, stream=True)


@pytest.fixture(scope="module")
def server():
    with own_server(ENV, "engine-process") as srv:
        yield srv


def engine_pids(log: str) -> list[int]:
    return [int(p) for p in re.findall(r"engine process (\d+) started", log)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def offline_tokens(prompts: list[list[int]]) -> list[list[int]]:
    from kvshare.engine.engine import LLMEngine
    from kvshare.engine.engine_config import EngineConfig
    from kvshare.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model="dummy:tiny-llama", device="cpu", num_pages=64))
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            got[out.request_id] += out.token_ids
    return [got[str(i)] for i in range(len(prompts))]


def stream(url: str, ids: list[int]) -> list[int]:
    with KvshareClient(url, stream_timeout=120) as client:
        return [t for chunk in client.stream(GenerationRequest(input_ids=ids, **GREEDY), model="llm_engine")
                for t in chunk.token_ids]


def test_the_engines_run_in_a_child_of_the_stub_and_stream_the_tokens_of_an_engine_here(server):
    [pid] = engine_pids(server.log())
    [stub] = server.stub_pids("llm_engine")
    with open(f"/proc/{pid}/status") as f:
        assert f"PPid:\t{stub}" in f.read()
    with ThreadPoolExecutor(4) as pool:
        served = list(pool.map(lambda ids: stream(server.addr.grpc_url, ids), PROMPTS))
    assert served == offline_tokens(PROMPTS)
    gauges = wait_for_idle_pool(server.addr.metrics_url)      # the engine process's ticks reach the metrics
    assert gauges["kvshare_kv_pages_total"] > 0


def test_a_cancelled_stream_ends_with_its_final_and_frees_its_pages(server):
    with KvshareClient(server.addr.grpc_url, stream_timeout=120) as client:
        with client.stream(GenerationRequest(input_ids=[9, 8, 7], **LONG), model="llm_engine") as s:
            for i, _ in enumerate(s):
                if i == 2:
                    break       # leaving the block cancels the gRPC stream
        done = s.completion()
    assert done.cancelled and done.finish_reason == "cancelled" and 3 <= len(done.token_ids) < 400
    wait_for_idle_pool(server.addr.metrics_url)
    assert pool_gauges(server.addr.metrics_url)["kvshare_requests_running"] == 0


def test_a_bad_request_is_refused_by_the_stub_naming_the_field(server):
    with KvshareClient(server.addr.grpc_url, stream_timeout=60) as client:
        with pytest.raises(KvshareClientError, match="input_ids: token id 999999 is outside the vocabulary"):
            client.generate(GenerationRequest(input_ids=[5, 999999], max_tokens=4), model="llm_engine")


def test_a_killed_engine_process_ends_its_requests_with_an_error_and_a_reload_serves_again(server):
    [pid] = engine_pids(server.log())
    streams = Streams(server.addr.grpc_url, 3)
    os.kill(pid, signal.SIGKILL)
    streams.join(60)
    assert all(end is not None and end[0] == "error" and "engine process exited unexpectedly (exit code -9)" in end[1]
               for end in streams.ends), streams.ends
    assert all(0 < n < 400 for n in streams.tokens), streams.tokens
    with KvshareClient(server.addr.grpc_url, stream_timeout=60) as client:
        with pytest.raises(KvshareClientError, match="engine process exited unexpectedly"):
            client.generate(GenerationRequest(input_ids=[5, 6, 7], max_tokens=4), model="llm_engine")
        assert _repository(server.addr, "llm_engine", "unload") == 200
        assert _repository(server.addr, "llm_engine", "load") == 200
        done = client.generate(GenerationRequest(input_ids=[5, 6, 7], max_tokens=4, ignore_eos=True),
                               model="llm_engine")
    assert done.finish_reason == "length" and len(done.token_ids) == 4
    assert len(engine_pids(server.log())) == 2 and not alive(pid)


def test_sigterm_under_load_ends_every_request_and_the_engine_process(tmp_path):
    with own_server(ENV, "engine-process-sigterm", extra_args=("--exit-timeout-secs=30",)) as srv:
        [pid] = engine_pids(srv.log())
        streams = Streams(srv.addr.grpc_url, 4)
        srv.proc.send_signal(signal.SIGTERM)
        try:
            rc = srv.proc.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still ran 15 s after SIGTERM; ends {streams.ends}\n{srv.log()[-6000:]}")
        streams.join(30)
        log = srv.log()
    assert rc == 0, log[-3000:]
    assert streams.ends == [("final", "cancelled")] * 4, streams.ends
    assert "kvshare engine stopped" in log and "Exit timeout expired" not in log
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the engine process outlived the server"
