"""Cancelling mid-stream ends the client's stream at once and frees the request on the server."""

import asyncio

import pytest

from client_live import metric, wait_for_metric
from kvshare_client import AsyncKvshareClient, GenerationRequest, KvshareClient

pytestmark = pytest.mark.server

# Forced long outputs (min_tokens = max_tokens): finishing them would take far longer than the
# time the server is given to free a cancelled request. 16 + 1500 tokens fit a 2k context.
LONG = dict(max_tokens=1500, min_tokens=1500, stream=True, temperature=0.0)
IDS = [504, 3458, 314, 253, 4214, 30, 1204, 2496, 288, 1102, 314, 2040, 30, 378, 3458, 30]
FREE_WITHIN_S = 15.0


def assert_server_busy(metrics_url):
    # Gauges are published on the engine's cadence: see the request counted before cancelling,
    # or a stale 0 read afterwards would pass for "freed".
    running = wait_for_metric(metrics_url, "kvshare_requests_running", lambda v: v >= 1, 10.0)
    assert running is not None and running >= 1, f"the request never showed up as running ({running})"


def assert_server_idle(metrics_url):
    for name in ("kvshare_requests_running", "kvshare_kv_pages_active"):
        assert metric(metrics_url, name) is not None, f"the server does not export {name}"
    running = wait_for_metric(metrics_url, "kvshare_requests_running", lambda v: v == 0, FREE_WITHIN_S)
    assert running == 0, f"kvshare_requests_running={running} {FREE_WITHIN_S}s after the cancel"
    active = wait_for_metric(metrics_url, "kvshare_kv_pages_active", lambda v: v == 0, 5.0)
    assert active == 0, f"kvshare_kv_pages_active={active}: pages still referenced after the cancel"


def test_sync_cancel_on_llm_engine_gets_a_final_result_and_frees_pages(triton_server):
    with KvshareClient(triton_server.grpc_url) as client:
        with client.stream(GenerationRequest(input_ids=IDS, **LONG), model="llm_engine") as s:
            for i, _ in enumerate(s):
                if i == 2:
                    assert_server_busy(triton_server.metrics_url)
                    break  # leaving the with block cancels the gRPC stream
        c = s.completion()
        assert c.cancelled and c.finish_reason == "cancelled" and len(c.token_ids) >= 3
        assert_server_idle(triton_server.metrics_url)
        # The pooled tritonclient client is reusable after a cancelled stream.
        again = client.generate(GenerationRequest(input_ids=IDS, max_tokens=2, stream=True), model="llm_engine")
        assert 1 <= len(again.token_ids) <= 2


def test_async_cancel_on_llm_engine(triton_server):
    async def main():
        async with AsyncKvshareClient(triton_server.grpc_url) as client:
            s = client.stream(GenerationRequest(input_ids=IDS, **LONG), model="llm_engine")
            n = 0
            async for _ in s:
                n += 1
                if n == 3:
                    await asyncio.to_thread(assert_server_busy, triton_server.metrics_url)
                    s.cancel()
            return s.completion()

    c = asyncio.run(main())
    assert c.cancelled and c.finish_reason == "cancelled"
    assert_server_idle(triton_server.metrics_url)


def test_cancel_through_the_ensemble_ends_the_client_stream(triton_server):
    request = GenerationRequest(
        prompt="Tell me a very long story.", apply_chat_template=True, **{**LONG, "max_tokens": 200, "min_tokens": 200}
    )
    with KvshareClient(triton_server.grpc_url) as client:
        with client.stream(request) as s:
            for i, _ in enumerate(s):
                if i == 2:
                    assert_server_busy(triton_server.metrics_url)
                    break
        assert s.completion().cancelled and s.completion().finish_reason == "cancelled"
    # Leave the server idle for the next tests whatever happens to the cancelled request.
    wait_for_metric(triton_server.metrics_url, "kvshare_requests_running", lambda v: v == 0, 120.0)


@pytest.mark.xfail(
    strict=False,
    reason=(
        "Triton 2.51's ensemble scheduler propagates a client cancel only between steps "
        "(triton-inference-server/core#263, server#6739): a request already running in the decoupled "
        "llm_engine step never sees is_cancelled() and runs to max_tokens"
    ),
)
def test_cancel_through_the_ensemble_frees_the_request(triton_server):
    request = GenerationRequest(
        prompt="Tell me a very long story.", apply_chat_template=True, **{**LONG, "max_tokens": 200, "min_tokens": 200}
    )
    try:
        with KvshareClient(triton_server.grpc_url) as client:
            with client.stream(request) as s:
                for i, _ in enumerate(s):
                    if i == 2:
                        assert_server_busy(triton_server.metrics_url)
                        break
        assert wait_for_metric(triton_server.metrics_url, "kvshare_requests_running", lambda v: v == 0, 3.0) == 0
    finally:
        wait_for_metric(triton_server.metrics_url, "kvshare_requests_running", lambda v: v == 0, 120.0)
