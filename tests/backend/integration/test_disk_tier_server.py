"""KVSHARE_DISK_CACHE_DIR through the real server, across a restart: a server with a 12-page pool, a
small host tier and a disk tier in a temporary directory serves a long prompt, a longer request
pushes every page of it out (through the host tier to files), and the server stops. A new server on
the same directory finds the files (its warm index), serves the prompt's first repeat from disk
(cached_tokens, the disk metrics) and streams the same tokens as the cold run did. A server of its
own each time (only llm_engine, SmolLM2 on the CPU)."""
from __future__ import annotations

import random
import time

import pytest
from server_helpers import own_llm_engine_server, wait_for_idle_pool

from kvshare_client import GenerationRequest, KvshareClient
from kvshare_client.metrics import fetch_metrics, metric_total, parse_samples

pytestmark = pytest.mark.server

_rng = random.Random(11)
PROMPT_A = [_rng.randrange(100, 40000) for _ in range(65)]     # 4 full pages of 16 + its last token
PROMPT_B = [_rng.randrange(100, 40000) for _ in range(181)]    # + 4 tokens: all 12 pages, so A's pages all go
GREEDY = {"temperature": 0.0, "stream": True, "max_tokens": 4, "min_tokens": 4}


def metric(addr, name: str) -> float:
    return metric_total(parse_samples(fetch_metrics(addr.metrics_url)), name) or 0.0


def wait_for_metric(addr, name: str, at_least: float, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (value := metric(addr, name)) < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} = {value} after {timeout_s} s, wanted >= {at_least}")
        time.sleep(0.25)
    return value


def test_a_restarted_server_serves_the_prompt_from_disk(tmp_path):
    env = {"KVSHARE_DEBUG_CHECKS": "true", "KVSHARE_NUM_PAGES": "12", "KVSHARE_HOST_CACHE_MEMORY_GB": "0.005",
           "KVSHARE_DISK_CACHE_DIR": str(tmp_path), "KVSHARE_DISK_CACHE_GB": "0.05"}
    with own_llm_engine_server(env, "disk") as addr:
        with KvshareClient(addr.grpc_url, stream_timeout=300) as client:
            cold = client.generate(GenerationRequest(input_ids=PROMPT_A, **GREEDY), model="llm_engine")
            shared = client.generate(GenerationRequest(input_ids=PROMPT_A, **GREEDY), model="llm_engine")
            client.generate(GenerationRequest(input_ids=PROMPT_B, **GREEDY), model="llm_engine")
        assert cold.cached_tokens == 0 and shared.cached_tokens == 64    # shared pages: the tiers keep them
        wait_for_idle_pool(addr.metrics_url)
        written = wait_for_metric(addr, "kvshare_kv_disk_pages_used", 4)
        assert metric(addr, "kvshare_kv_tier_migration_bytes_total") > 0
    files = sorted(tmp_path.glob("*/*.kvpage"))
    assert len(files) == written and not list(tmp_path.glob("*/*.tmp"))

    with own_llm_engine_server(env, "disk-restart") as addr:
        assert wait_for_metric(addr, "kvshare_kv_disk_pages_used", written) == written   # the warm index, no request yet
        with KvshareClient(addr.grpc_url, stream_timeout=300) as client:
            again = client.generate(GenerationRequest(input_ids=PROMPT_A, **GREEDY), model="llm_engine")
        wait_for_idle_pool(addr.metrics_url)
        assert again.cached_tokens == 64                                      # every full page, from disk
        assert wait_for_metric(addr, "kvshare_prefix_cache_disk_hits_tokens_total", 64) == 64
        assert metric(addr, "kvshare_kv_disk_read_failures_total") == 0
    assert again.token_ids == cold.token_ids
