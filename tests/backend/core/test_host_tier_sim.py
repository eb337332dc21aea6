"""The host tier through the scheduler, on the shadow runner (every KV slot holds the fingerprint of
its prefix): pages evicted from a small pool are spilled, come back by loads instead of being
recomputed, and every read still sees its own prefix."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core_sim import make_runner


PROMPT_A = list(range(1, 18))                 # 4 full pages of 4 + 1 token
PROMPT_B = list(range(30, 58))                # 7 full pages: pushes A's pages out of an 8-page pool


def test_evicted_prefix_comes_back_from_the_host():
    page = 4
    prompt_a, prompt_b = PROMPT_A, PROMPT_B
    for host_slots, expect_cached in ((0, 0), (8, 16)):
        r = make_runner(num_pages=8, page_size=page, host_slots=host_slots)
        for seq_id, prompt in enumerate((prompt_a, prompt_a, prompt_b)):   # A twice: its pages were shared
            r.add(seq_id, prompt, max_new_tokens=2)
            r.run_until_idle()
        computed_before = r.tokens_computed
        r.add(3, prompt_a, max_new_tokens=2)
        r.run_until_idle()
        assert r.kv.host_hits_tokens_total == expect_cached
        # the repeat computes only what neither tier held: its last prompt token, then its decode
        assert r.tokens_computed - computed_before == (len(prompt_a) - expect_cached) + 1
        r.kv.check_integrity()
        if r.kv.host is not None:
            r.kv.host.check_integrity()


@pytest.mark.parametrize("min_hits, expect_cached", [(1, 0), (0, 16)])
def test_only_shared_pages_are_spilled_by_default(min_hits, expect_cached):
    """A prompt nobody shared is not kept on the host (selective write-through); with
    host_min_hits=0 every evicted page is."""
    r = make_runner(num_pages=8, page_size=4, host_slots=8, host_min_hits=min_hits)
    for seq_id, prompt in enumerate((PROMPT_A, PROMPT_B, PROMPT_A)):
        r.add(seq_id, prompt, max_new_tokens=2)
        r.run_until_idle()
    assert r.kv.host_hits_tokens_total == expect_cached
    r.kv.check_integrity()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_pages=st.integers(6, 14), host_slots=st.integers(1, 12), seed=st.integers(0, 10_000),
       n=st.integers(2, 10), overlap=st.booleans())
def test_random_traffic_reads_only_its_own_prefixes(num_pages, host_slots, seed, n, overlap):
    import random

    rng = random.Random(seed)
    systems = [[rng.randrange(1, 40) for _ in range(rng.randrange(4, 13))] for _ in range(3)]
    r = make_runner(num_pages=num_pages, page_size=4, max_running=3, max_step_tokens=16, max_prefill_chunk=8,
                    host_slots=host_slots)
    for i in range(n):
        prompt = rng.choice(systems) + [rng.randrange(1, 40) for _ in range(rng.randrange(1, 6))]
        r.add(i, prompt[: 4 * num_pages - 8], max_new_tokens=rng.randrange(1, 5))
    for _ in range(2000):
        if not (r.scheduler.num_running or r.scheduler.num_waiting):
            break
        r.launch() if overlap else r.step()
        if overlap and r.scheduler.num_unresolved > 1:
            r.resolve()
        r.kv.host.check_integrity()
    else:
        raise AssertionError("not idle after 2000 steps")
    while r.scheduler.num_unresolved:
        r.resolve()
    r.kv.check_integrity()
    assert r.kv.pool.num_active == 0
