"""Faults injected into the real server (KVSHARE_FAULTS, engine/faults.py) and per-request
timeouts. A server of its own: only llm_engine, dummy weights (no tokenizer, so the detokenize site
is covered by tests/backend/engine/test_engine_faults.py), each fault firing once, in the order a
request meets them: forward, then sample, then pump. Every faulty request gets one error final, its
pages return, and the next request is served."""
from __future__ import annotations

import queue

import pytest
import tritonclient.grpc as grpcclient
from server_helpers import own_server, wait_for_idle_pool

from kvshare_client import GenerationRequest, KvshareClient
from kvshare_client.errors import ServerError
from kvshare_client.wire import build_tensors, to_infer_inputs

pytestmark = pytest.mark.server

FAULTS = "forward:1:1,sample:1:1,pump:1:1,slow_step:10ms"
IDS = [5, 34, 31, 25, 42, 30, 12, 24]


@pytest.fixture(scope="module")
def server():
    env = {"KVSHARE_MODEL": "dummy:tiny-llama", "KVSHARE_DEBUG_CHECKS": "true", "KVSHARE_FAULTS": FAULTS}
    with own_server(env, "faults") as srv:
        yield srv
        log = srv.log()
    assert "FAULT INJECTION IS ON" in log


def idle(server) -> None:
    g = wait_for_idle_pool(server.addr.metrics_url, timeout_s=10)
    assert g["kvshare_kv_pages_free"] + g["kvshare_kv_pages_cached"] == g["kvshare_kv_pages_total"]


def test_each_fault_ends_its_request_with_an_error_and_the_next_request_is_served(server):
    req = GenerationRequest(input_ids=IDS, max_tokens=20, min_tokens=20, temperature=0.0, stream=True)
    with KvshareClient(server.addr.grpc_url, stream_timeout=120) as client:
        for site in ("forward", "sample", "pump"):
            with pytest.raises(ServerError, match=f"injected {site} fault #1"):
                client.generate(req, model="llm_engine")
            idle(server)
        done = client.generate(req, model="llm_engine")
    assert done.finish_reason == "length" and len(done.token_ids) == 20
    idle(server)


def stream_with_timeout(url: str, req: GenerationRequest, timeout_us: int) -> tuple[int, list[str], bool]:
    """(responses, errors, final seen) of one request sent with Triton's request `timeout`."""
    got: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: got.put((result, error)), stream_timeout=120)
    client.async_stream_infer("llm_engine", to_infer_inputs(build_tensors(req)), timeout=timeout_us,
                              enable_empty_final_response=True)
    responses, errors, final = 0, [], False
    try:
        while not final and not errors:
            result, error = got.get(timeout=120)
            if error is not None:
                errors.append(str(error))
                continue
            responses += 1
            final = result.get_response().parameters["triton_final_response"].bool_param
    finally:
        client.stop_stream()
        client.close()
    return responses, errors, final


def test_a_request_past_its_timeout_ends_with_a_clear_error_and_frees_its_pages(server):
    # 400 steps of >= 10 ms: far past a 300 ms timeout
    req = GenerationRequest(input_ids=IDS, max_tokens=400, min_tokens=400, temperature=0.0, stream=True)
    responses, errors, final = stream_with_timeout(server.addr.grpc_url, req, timeout_us=300_000)
    assert len(errors) == 1 and not final, (errors, final)
    assert "timeout" in errors[0] and "300 ms" in errors[0], errors
    assert responses < 400
    idle(server)


def test_a_request_within_its_timeout_is_untouched(server):
    req = GenerationRequest(input_ids=IDS, max_tokens=8, min_tokens=8, temperature=0.0, stream=True)
    responses, errors, final = stream_with_timeout(server.addr.grpc_url, req, timeout_us=120_000_000)
    assert errors == [] and final and responses >= 8
    idle(server)
