"""KVSHARE_HOST_CACHE_MEMORY_GB through the real server: with a 12-page pool, a prompt whose cached
pages a longer request pushed out comes back from the host tier (cached_tokens, the host metrics)
and streams the same tokens as a server that never evicted it. A server of its own (only llm_engine,
SmolLM2 on the CPU)."""
from __future__ import annotations

import random

import pytest
from server_helpers import own_llm_engine_server, wait_for_counter, wait_for_idle_pool

from kvshare_client import GenerationRequest, KvshareClient
from kvshare_client.metrics import fetch_metrics, metric_total, parse_samples

pytestmark = pytest.mark.server

_rng = random.Random(5)
PROMPT_A = [_rng.randrange(100, 40000) for _ in range(65)]     # 4 full pages of 16 + its last token
PROMPT_B = [_rng.randrange(100, 40000) for _ in range(140)]    # 9 pages of a 12-page pool: A's pages go
GREEDY = {"temperature": 0.0, "stream": True, "max_tokens": 4, "min_tokens": 4}


@pytest.fixture(scope="module")
def tier_server():
    env = {"KVSHARE_DEBUG_CHECKS": "true", "KVSHARE_NUM_PAGES": "12", "KVSHARE_HOST_CACHE_MEMORY_GB": "0.05"}
    with own_llm_engine_server(env, "tier") as addr:
        yield addr


def test_evicted_prefix_comes_back_from_the_host_tier(tier_server, triton_server):
    with KvshareClient(tier_server.grpc_url, stream_timeout=300) as client:
        first = client.generate(GenerationRequest(input_ids=PROMPT_A, **GREEDY), model="llm_engine")
        shared = client.generate(GenerationRequest(input_ids=PROMPT_A, **GREEDY), model="llm_engine")
        client.generate(GenerationRequest(input_ids=PROMPT_B, **GREEDY), model="llm_engine")
        again = client.generate(GenerationRequest(input_ids=PROMPT_A, **GREEDY), model="llm_engine")
    assert first.cached_tokens == 0 and shared.cached_tokens == 64   # shared pages: the tier keeps them
    assert again.cached_tokens == 64
    wait_for_idle_pool(tier_server.metrics_url)
    samples = parse_samples(fetch_metrics(tier_server.metrics_url))
    assert metric_total(samples, "kvshare_kv_host_pages_total") > 0
    assert wait_for_counter(tier_server.metrics_url, "kvshare_kv_host_spills_total") > 0
    host_hits = wait_for_counter(tier_server.metrics_url, "kvshare_prefix_cache_host_hits_tokens_total")
    assert 0 < host_hits <= 64 and host_hits % 16 == 0
    # the server with a roomy pool serves A's second run from pages that never left the device
    with KvshareClient(triton_server.grpc_url, stream_timeout=300) as roomy:
        roomy.generate(GenerationRequest(input_ids=PROMPT_A, cache_salt="tier-check", **GREEDY), model="llm_engine")
        want = roomy.generate(GenerationRequest(input_ids=PROMPT_A, cache_salt="tier-check", **GREEDY),
                              model="llm_engine")
    assert want.cached_tokens == 64
    assert again.token_ids == want.token_ids
