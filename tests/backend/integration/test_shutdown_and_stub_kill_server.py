"""SIGTERM under streaming load, and a Python-backend stub killed with kill -9, on servers of their
own (only llm_engine, dummy weights, KVSHARE_FAULTS=slow_step so that requests stay in flight).

Triton 2.51 finalizes a decoupled model only after every response factory is released, i.e. after
every request in flight has ended, and does not cancel them on shutdown: the engine learns of the
shutdown from the model turning unready and ends them itself (docs/operate/troubleshoot.md)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
from server_helpers import own_server, pool_gauges, wait_for_idle_pool

from kvshare import launch
from kvshare_client import GenerationRequest, KvshareClient
from kvshare_client.errors import KvshareClientError

pytestmark = pytest.mark.server

ENV = {"KVSHARE_MODEL": "dummy:tiny-llama", "KVSHARE_DEBUG_CHECKS": "true", "KVSHARE_FAULTS": "slow_step:20ms"}
LONG = dict(max_tokens=400, min_tokens=400, temperature=0.0, stream=True)   # >= 8 s at 20 ms a step
EXIT_TIMEOUT_S = 30


class Streams:
    """n streaming requests on their own threads: each one's tokens and how it ended."""

    def __init__(self, url: str, n: int, stream_timeout: float = 120.0):
        self.stream_timeout = stream_timeout
        self.tokens = [0] * n
        self.ends: list[tuple | None] = [None] * n
        self.started = threading.Barrier(n + 1)
        self._threads = [threading.Thread(target=self._run, args=(url, i), daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()
        self.started.wait(120)

    def _run(self, url: str, i: int) -> None:
        first = True
        try:
            with KvshareClient(url, stream_timeout=self.stream_timeout) as client:
                for chunk in client.stream(GenerationRequest(input_ids=[5, 6, 7 + i], **LONG), model="llm_engine"):
                    self.tokens[i] += len(chunk.token_ids)
                    if first:
                        first = False
                        self.started.wait(120)
                    if chunk.is_final:
                        self.ends[i] = ("final", chunk.finish_reason)
        except KvshareClientError as exc:
            self.ends[i] = ("error", str(exc))
            if first:
                self.started.abort()

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)


def test_sigterm_under_load_ends_every_request_with_a_final_and_exits_well_inside_the_timeout():
    with own_server(ENV, "sigterm", extra_args=(f"--exit-timeout-secs={EXIT_TIMEOUT_S}",)) as srv:
        stubs = srv.stub_pids()
        streams = Streams(srv.addr.grpc_url, 6)
        srv.proc.send_signal(signal.SIGTERM)
        # the requests would run ~8 s more each; the server must not wait for them
        try:
            rc = srv.proc.wait(EXIT_TIMEOUT_S / 2)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still ran {EXIT_TIMEOUT_S / 2:.0f} s after SIGTERM; tokens so far "
                        f"{streams.tokens}, ends {streams.ends}\n{srv.log()[-6000:]}")
        streams.join(30)
        log = srv.log()
    assert rc == 0, log[-3000:]
    assert streams.ends == [("final", "cancelled")] * 6, streams.ends
    assert all(0 < n < 400 for n in streams.tokens), streams.tokens
    assert "ending the 6 requests in flight" in log and "kvshare engine stopped" in log
    assert "Exit timeout expired" not in log
    assert stubs and not [p for p in stubs if os.path.exists(f"/proc/{p}")], "a stub outlived the server"


def _ready(addr, path: str) -> int:
    try:
        with urllib.request.urlopen(f"{addr.http_url}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _repository(addr, model: str, action: str) -> int:
    req = urllib.request.Request(f"{addr.http_url}/v2/repository/models/{model}/{action}", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.status


def test_an_unload_under_load_ends_every_request_with_a_final_and_a_load_serves_again():
    with own_server(ENV, "unload") as srv:
        streams = Streams(srv.addr.grpc_url, 3)
        [stub] = srv.stub_pids("llm_engine")
        assert _repository(srv.addr, "llm_engine", "unload") == 200
        streams.join(30)
        assert streams.ends == [("final", "cancelled")] * 3, streams.ends
        assert all(0 < n < 400 for n in streams.tokens), streams.tokens
        assert launch.wait_for_stub_death(srv.proc, [stub], poll_s=0.1) == stub
        assert _repository(srv.addr, "llm_engine", "load") == 200
        with KvshareClient(srv.addr.grpc_url, stream_timeout=60) as client:
            done = client.generate(GenerationRequest(input_ids=[5, 6, 7], max_tokens=4, ignore_eos=True),
                                   model="llm_engine")
        assert done.finish_reason == "length" and len(done.token_ids) == 4
        assert "ending the 3 requests in flight" in srv.log()


def test_a_killed_stub_fails_its_requests_clearly_and_a_reload_brings_the_model_back():
    with own_server(ENV, "stubkill") as srv:
        addr = srv.addr
        [stub] = srv.stub_pids("llm_engine")
        streams = Streams(addr.grpc_url, 1, stream_timeout=10)
        os.kill(stub, signal.SIGKILL)
        assert launch.wait_for_stub_death(srv.proc, [stub], poll_s=0.1) == stub
        streams.join(60)
        # Triton 2.51 sends the request in flight nothing more, neither an error nor a final: only
        # the client's own deadline ends it (and its response factory is never released, so this
        # server's shutdown waits out --exit-timeout-secs)
        assert streams.ends[0] is not None and streams.ends[0][0] == "error", streams.ends
        assert "deadline" in streams.ends[0][1].lower() and 0 < streams.tokens[0] < 400, (streams.ends, streams.tokens)
        # Triton 2.51: the stub is not restarted and the model still reads ready...
        assert _ready(addr, "/v2/models/llm_engine/ready") == 200 and _ready(addr, "/v2/health/ready") == 200
        assert srv.stub_pids("llm_engine") == []
        # ...while every request fails at once, with a message that says why
        with KvshareClient(addr.grpc_url, stream_timeout=60) as client:
            with pytest.raises(KvshareClientError, match="not healthy"):
                client.generate(GenerationRequest(input_ids=[5, 6, 7], max_tokens=4), model="llm_engine")
            # explicit model control: unload + load starts a fresh stub (a plain load is a no-op)
            assert _repository(addr, "llm_engine", "unload") == 200
            assert _repository(addr, "llm_engine", "load") == 200
            assert len(srv.stub_pids("llm_engine")) == 1
            done = client.generate(GenerationRequest(input_ids=[5, 6, 7], max_tokens=4, temperature=0.0),
                                   model="llm_engine")
        assert done.finish_reason == "length" and len(done.token_ids) == 4
        gauges = wait_for_idle_pool(addr.metrics_url)
        assert gauges["kvshare_kv_pages_free"] + gauges["kvshare_kv_pages_cached"] == gauges["kvshare_kv_pages_total"]
        assert pool_gauges(addr.metrics_url)["kvshare_requests_running"] == 0
