"""Safe defaults through the real server (docs/operate/security.md): it listens on 127.0.0.1 only, prompts
past max_prompt_bytes / the token limit are refused naming the input on every model, and cache_salt
keeps tenants' prefixes apart under concurrent load (reused-token counts of identical prompts)."""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvshare_client import GenerationRequest, KvshareClient
from server_helpers import post, wait_for_idle_pool
from test_server_errors import raw_stream

pytestmark = pytest.mark.server

PAGE_SIZE = 16                      # model_repository/llm_engine/config.pbtxt
OVER_BYTES = (1 << 20) + 1          # one byte past the text models' default max_prompt_bytes


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp*) of the sockets listening on port."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            addr, state = fields[1], fields[3]
            if state == "0A" and int(addr.rsplit(":", 1)[1], 16) == port:     # 0A: LISTEN
                found.append(addr.rsplit(":", 1)[0])
    return found


def test_the_server_listens_on_loopback_only(triton_server):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc/net/tcp")
    for port in (triton_server.http_port, triton_server.grpc_port, triton_server.metrics_port):
        addrs = _listening(port)
        assert addrs, f"nothing listens on port {port}"
        # 127.0.0.1 as /proc/net/tcp writes it (0100007F; 0.0.0.0 would be 00000000), in tcp6 as ::1 or
        # as the IPv4-mapped ::ffff:127.0.0.1
        loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
        assert set(addrs) <= loopback, (port, addrs)


def _text(s: bytes):
    return np.array([[s]], dtype=np.object_), "BYTES"


@pytest.mark.parametrize("model", ["ensemble", "llm_bls"])
def test_a_prompt_past_max_prompt_bytes_is_refused_naming_text_input(triton_server, model):
    _, error = raw_stream(triton_server.grpc_url, model, {"text_input": _text(b"a" * OVER_BYTES)})
    assert error is not None and "text_input" in error and "max_prompt_bytes" in error, error


def test_vllm_model_refuses_a_prompt_past_max_prompt_bytes(triton_server):
    status, _, body = post(f"{triton_server.http_url}/v2/models/vllm_model/generate",
                           {"text_input": "a" * OVER_BYTES, "max_tokens": 2})
    assert status == 400 and "text_input" in body and "max_prompt_bytes" in body, (status, body[:300])


@pytest.mark.parametrize("model", ["llm_bls", "vllm_model"])
def test_a_prompt_past_the_context_is_refused_naming_text_input(triton_server, model):
    body = {"text_input": "word " * 9000, "max_tokens": 2}
    status, _, text = post(f"{triton_server.http_url}/v2/models/{model}/generate", body)
    assert status == 400, (status, text[:300])
    message = json.loads(text)["error"]
    assert message.startswith("text_input: ") and "tokens" in message, message


def test_a_token_prompt_past_the_context_is_refused_naming_input_ids(triton_server):
    _, error = raw_stream(triton_server.grpc_url, "llm_engine",
                          {"input_ids": (np.full((1, 8192), 5, dtype=np.int32), "INT32")})
    assert error is not None and error.startswith("input_ids: ") and "8192 tokens" in error, error
    wait_for_idle_pool(triton_server.metrics_url)


def _prompt(tokenizer, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = "amber birch comet delta ember fjord glyph heron iris jade kelp lumen".split()
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" " + " ".join(rng.choice(words) for _ in range(n)), add_special_tokens=False)
    return ids[:n]


ROUNDS, THREADS, PROMPT = 5, 4, 4 * PAGE_SIZE


def test_identical_prompts_under_two_salts_never_share_a_page_under_load(triton_server, tokenizer):
    """Per round, a fresh prompt: tenant A's first request is prefilled (its pages are registered and
    still referenced while it decodes), then tenant B and A again send the identical prompt at the same
    time, then B again. A page computed for A would show in B's reused-token count; A's second and
    B's second request show that each salt's own pages are reused (so the zeros mean isolation)."""
    full_pages = (PROMPT - 1) // PAGE_SIZE * PAGE_SIZE      # the last token is always computed

    def round_(client: KvshareClient, r: int) -> dict[str, int]:
        ids = _prompt(tokenizer, PROMPT, seed=1000 + r)
        salt_a, salt_b = f"tenant-a-{r}", f"tenant-b-{r}"     # a1 and b1 are their salt's first request
        base = dict(input_ids=ids, temperature=0.0, ignore_eos=True)
        first = client.stream(GenerationRequest(**base, max_tokens=24, stream=True, cache_salt=salt_a))
        next(iter(first))                     # A's prompt is computed; A is still decoding
        with ThreadPoolExecutor(2) as pool:
            b1 = pool.submit(client.generate, GenerationRequest(**base, max_tokens=3, cache_salt=salt_b))
            a2 = pool.submit(client.generate, GenerationRequest(**base, max_tokens=3, cache_salt=salt_a))
            b1, a2 = b1.result(), a2.result()
        a1 = first.result()
        b2 = client.generate(GenerationRequest(**base, max_tokens=3, cache_salt=salt_b))
        return {"a1": a1.cached_tokens, "b1": b1.cached_tokens, "a2": a2.cached_tokens, "b2": b2.cached_tokens}

    with KvshareClient(triton_server.grpc_url, stream_timeout=300) as client:
        with ThreadPoolExecutor(THREADS) as pool:
            rounds = list(pool.map(lambda r: round_(client, r), range(ROUNDS * THREADS)))
    for r, got in enumerate(rounds):
        assert got["a1"] == 0 and got["b1"] == 0, (r, got)           # nothing of the other salt, ever
        assert got["a2"] >= full_pages and got["b2"] >= full_pages, (r, got)
    g = wait_for_idle_pool(triton_server.metrics_url)
    assert g["kvshare_kv_pages_free"] + g["kvshare_kv_pages_cached"] == g["kvshare_kv_pages_total"], g
