"""KVSHARE_STREAM_INTERVAL through the real server: deltas go out every N tokens (the first at once),
join to the full text, carry the same tokens as the every-token server, and cancelling still frees
the request. A second server of its own (only llm_engine loaded, SmolLM2 on the CPU)."""
from __future__ import annotations

import math

import pytest
from server_helpers import own_llm_engine_server, wait_for_idle_pool

from kvshare_client import GenerationRequest, KvshareClient

pytestmark = pytest.mark.server

INTERVAL = 4
IDS = [504, 3458, 314, 253, 4214, 30, 1204, 2496, 288, 1102, 314, 2040, 30, 378, 3458, 30]
FORCED = {"temperature": 0.0, "stream": True}


@pytest.fixture(scope="module")
def interval_server():
    env = {"KVSHARE_DEBUG_CHECKS": "true", "KVSHARE_STREAM_INTERVAL": str(INTERVAL)}
    with own_llm_engine_server(env, "interval") as addr:
        yield addr


@pytest.fixture(scope="module")
def client(interval_server):
    with KvshareClient(interval_server.grpc_url, stream_timeout=300) as c:
        yield c


def test_deltas_come_every_n_tokens_and_join_to_the_full_text(client, tokenizer):
    n = 30
    req = GenerationRequest(input_ids=IDS, max_tokens=n, min_tokens=n, **FORCED)
    chunks = [c for c in client.stream(req, model="llm_engine")]
    sizes = [len(c.token_ids) for c in chunks if c.token_ids]
    assert sum(sizes) == n
    assert sizes[0] == 1, "the first token is never held back"
    assert all(k >= INTERVAL for k in sizes[1:-1]), sizes
    assert len(sizes) <= 1 + math.ceil((n - 1) / INTERVAL), sizes
    ids = [t for c in chunks for t in c.token_ids]
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids, skip_special_tokens=True)


def test_same_tokens_and_text_as_the_every_token_server(client, triton_server):
    reqs = [GenerationRequest(input_ids=IDS[:k], max_tokens=23, **FORCED) for k in (5, 9, 16)]
    with KvshareClient(triton_server.grpc_url, stream_timeout=300) as every_token:
        want = [every_token.generate(r, model="llm_engine") for r in reqs]
    got = [client.generate(r, model="llm_engine") for r in reqs]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == w.finish_reason
        assert g.num_responses <= w.num_responses


def test_a_non_streaming_request_still_gets_one_response(client):
    done = client.generate(GenerationRequest(input_ids=IDS, max_tokens=9, min_tokens=9, temperature=0.0,
                                             stream=False), model="llm_engine")
    assert len(done.token_ids) == 9 and done.finish_reason == "length"
    assert done.num_responses == 1


def test_cancel_mid_stream_frees_the_request(client, interval_server):
    long = GenerationRequest(input_ids=IDS, max_tokens=1500, min_tokens=1500, **FORCED)
    with client.stream(long, model="llm_engine") as s:
        for i, _ in enumerate(s):
            if i == 2:
                break   # leaving the with block cancels the gRPC stream
    c = s.completion()
    assert c.cancelled and c.finish_reason == "cancelled"
    assert len(c.token_ids) >= 1 + 2 * INTERVAL
    wait_for_idle_pool(interval_server.metrics_url, timeout_s=15.0)
