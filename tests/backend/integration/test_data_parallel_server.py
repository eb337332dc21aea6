"""KVSHARE_DATA_PARALLEL_SIZE=2 through the real Triton server: one llm_engine instance drives two
CPU engines (tiny dummy model, two 64-page pools). Requests that repeat a prefix land on the engine
that holds it and are served from its pages, which its own metrics show (engine label); a burst of
one prefix stays together; other prompts go to the idle engine; round robin would have split them.
A server of its own (only llm_engine)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_helpers import own_llm_engine_server, wait_for_idle_pool

from kvshare_client import GenerationRequest, KvshareClient
from kvshare_client.metrics import fetch_metrics, parse_samples

pytestmark = pytest.mark.server

PREFIX = [(13 * i) % 240 + 5 for i in range(48)]          # 3 full pages of 16
OTHER = [(29 * i) % 240 + 7 for i in range(40)]
GREEDY = {"temperature": 0.0, "max_tokens": 4, "min_tokens": 4, "stream": True}


@pytest.fixture(scope="module")
def dp_server():
    env = {"KVSHARE_DEBUG_CHECKS": "true", "KVSHARE_MODEL": "dummy:tiny-llama", "KVSHARE_NUM_PAGES": "64",
           "KVSHARE_DATA_PARALLEL_SIZE": "2", "KVSHARE_MAX_RUNNING": "8"}
    with own_llm_engine_server(env, "data-parallel") as addr:
        yield addr


def by_engine(metrics_url: str, name: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in parse_samples(fetch_metrics(metrics_url)):
        d = dict(s.labels)
        if s.name == name and all(d.get(k) == v for k, v in labels.items()):
            out[d["engine"]] = out.get(d["engine"], 0.0) + s.value
    return out


def eventually(read, want, timeout_s: float = 10.0):
    """Metrics are published every ~0.5 s: poll until read() == want."""
    deadline = time.monotonic() + timeout_s
    while (got := read()) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    assert got == want


def generate(url: str, ids: list[int], salt: str):
    with KvshareClient(url, stream_timeout=120) as client:
        return client.generate(GenerationRequest(input_ids=ids, cache_salt=salt, **GREEDY), model="llm_engine")


def test_repeated_prefixes_land_on_the_engine_that_has_them(dp_server):
    url, metrics = dp_server.grpc_url, dp_server.metrics_url
    eventually(lambda: by_engine(metrics, "kvshare_kv_pages_total"), {"0": 64.0, "1": 64.0})
    first = generate(url, PREFIX + [1], "affinity")
    assert first.cached_tokens == 0
    eventually(lambda: sum(by_engine(metrics, "kvshare_prompt_tokens_total").values()), 49.0)
    holder = max(by_engine(metrics, "kvshare_prompt_tokens_total").items(), key=lambda kv: kv[1])[0]
    other = "1" if holder == "0" else "0"
    again = [generate(url, PREFIX + [2 + i, 3], "affinity") for i in range(3)]
    assert [r.cached_tokens for r in again] == [48, 48, 48]
    # a prompt nobody holds goes to the idle engine
    generate(url, OTHER, "affinity")
    eventually(lambda: sum(by_engine(metrics, "kvshare_prompt_tokens_total").values()), 49.0 + 3 * 50 + len(OTHER))
    wait_for_idle_pool(metrics)
    hits = by_engine(metrics, "kvshare_prefix_cache_hits_tokens_total")
    assert hits.get(holder) == 3 * 48 and hits.get(other, 0) == 0
    prompts = by_engine(metrics, "kvshare_prompt_tokens_total")
    assert prompts[holder] == 49 + 3 * 50 and prompts[other] == len(OTHER)
    routed = by_engine(metrics, "kvshare_router_requests_total", reason="affinity")
    assert routed.get(holder) == 3 and routed.get(other, 0) == 0


def test_a_burst_of_one_prefix_stays_on_one_engine(dp_server):
    url, metrics = dp_server.grpc_url, dp_server.metrics_url
    before = by_engine(metrics, "kvshare_prompt_tokens_total")
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: generate(url, PREFIX + [100 + i], "burst"), range(4)))
    eventually(lambda: sum(by_engine(metrics, "kvshare_prompt_tokens_total").values()),
               sum(before.values()) + 4 * 49)
    wait_for_idle_pool(metrics)
    after = by_engine(metrics, "kvshare_prompt_tokens_total")
    grew = {e for e in after if after[e] > before.get(e, 0)}
    assert len(grew) == 1          # all four on one engine, before any of them had registered a page
    assert all(len(r.token_ids) == 4 for r in results)
    gauges = {name: by_engine(metrics, name) for name in ("kvshare_kv_pages_active", "kvshare_requests_running")}
    assert all(v == 0 for g in gauges.values() for v in g.values()), gauges
