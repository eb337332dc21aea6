"""The wire-contract fuzzer (perf/server/wire_fuzz.py), a CI-sized and derandomized slice of it,
against the session's real server: random subsets of every model's declared inputs (contract.py)
with random dtypes, shapes and values over gRPC streaming, gRPC unary and HTTP generate /
generate_stream. Each request ends with exactly one final response or an error naming an input,
the server stays ready, and afterwards no page is referenced and free + cached = total.

The long run: `python -m perf.server.wire_fuzz --minutes N` (docs/develop/testing.md, "Wire fuzzing").
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_helpers import wait_for_idle_pool

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from perf.server import wire_fuzz as W  # noqa: E402

pytestmark = pytest.mark.server

EXAMPLES = 30       # per model: ~1 min for all five on the 2-core CPU machine


@pytest.fixture(scope="module")
def urls(triton_server):
    return W.Urls(triton_server.grpc_url, triton_server.http_url, triton_server.metrics_url)


@pytest.mark.parametrize("model", W.MODELS)
def test_every_request_ends_with_one_final_response_or_an_error_naming_an_input(urls, triton_server, model):
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(W.fuzz_requests(model), min_size=1, max_size=2))
    def check(reqs):
        for req, out in zip(reqs, W.send_all(urls, reqs, timeout=180.0)):
            assert out.kind in W.GOOD, f"{out.kind}: {out.detail}\n{req.describe()}"
        assert W.server_ready(urls), "the server is no longer ready"

    check()
    g = wait_for_idle_pool(triton_server.metrics_url, timeout_s=60)
    assert g["kvshare_kv_pages_free"] + g["kvshare_kv_pages_cached"] == g["kvshare_kv_pages_total"], g


def test_the_classifier_tells_a_named_refusal_from_an_internal_error():
    assert W.classify_error("ensemble", "in ensemble 'ensemble', max_tokens: must be > 0, got 0") == "refused"
    assert W.classify_error("llm_engine", "inference request batch-size must be <= 64 for 'llm_engine'") == "refused"
    assert W.classify_error("llm_bls", "llm_bls: 'NoneType' object has no attribute 'as_numpy'") == "internal_error"
    assert W.classify_error("vllm_model", "parameters.unknown_key: is not a sampling parameter") == "refused"
    assert W.classify_error("vllm_model", "something went wrong") == "unclear_error"


@settings(max_examples=100, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(W.fuzz_requests())
def test_requests_use_only_declared_inputs_and_stay_small(req):
    declared = {t.name for t in W._declared(req.model)}
    assert set(req.names()) <= declared, set(req.names()) - declared
    assert sum(t.array.nbytes if t.dtype != "BYTES" else sum(len(v) for v in t.array.reshape(-1))
               for t in req.tensors) < 4 << 20
