"""RawStreamSession's timeout is each request's deadline, not the long-lived gRPC call's: a session
that has streamed for longer than the timeout still serves its next request, a request that runs
past it ends with StreamTimeout (and the server frees it), and the session serves the next one."""

import time

import pytest

from client_live import wait_for_metric
from kvshare_client import GenerationRequest
from kvshare_client.errors import StreamTimeout
from kvshare_client.raw_stream import RawStreamSession
from kvshare_client.wire import build_tensors

pytestmark = pytest.mark.server

IDS = [504, 3458, 314, 253, 4214, 30, 1204, 2496, 288, 1102, 314, 2040, 30, 378, 3458, 30]
TIMEOUT_S = 2.0


def tensors(max_tokens: int):
    return build_tensors(GenerationRequest(input_ids=IDS, max_tokens=max_tokens, min_tokens=max_tokens,
                                           stream=True, temperature=0.0))


def test_the_timeout_counts_per_request_not_from_the_streams_opening(triton_server):
    with RawStreamSession(triton_server.grpc_url, stream_timeout=TIMEOUT_S) as session:
        opened = time.monotonic()
        served = 0
        while time.monotonic() - opened < 1.5 * TIMEOUT_S:
            c = session.generate("llm_engine", tensors(2))
            assert len(c.token_ids) == 2
            served += 1
        assert served >= 2

        started = time.monotonic()
        with pytest.raises(StreamTimeout, match=r"within 2 s"):
            session.generate("llm_engine", tensors(1500))
        waited = time.monotonic() - started
        assert TIMEOUT_S <= waited < TIMEOUT_S + 5.0, waited

        again = session.generate("llm_engine", tensors(2))
        assert len(again.token_ids) == 2
    running = wait_for_metric(triton_server.metrics_url, "kvshare_requests_running", lambda v: v == 0, 15.0)
    assert running == 0, f"the timed-out request still runs on the server ({running})"
