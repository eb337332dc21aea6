"""Router (data parallel): prefix affinity from each engine's real prefix index, the in-flight
record, the imbalance bound, cache_salt in the routing key, round robin; a probe from another
thread while an engine's cache changes."""
from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.core import KVCacheManager
from kvshare.core.router import RouteDecision, Router, RouterSettings

PAGE = 4


def cache_prompt(kv: KVCacheManager, seq_id: int, tokens: list[int], salt: bytes = b"") -> None:
    """Compute a whole prompt and end the sequence: its full pages stay cached (unreferenced)."""
    assert kv.admit(seq_id, tokens, salt, token_budget=10_000) is not None
    kv.release_pins()
    kv.commit(seq_id, tokens, len(tokens))
    kv.free(seq_id, tokens)


def engines(n: int, pages: int = 64) -> list[KVCacheManager]:
    return [KVCacheManager(pages, PAGE) for _ in range(n)]


def route(router: Router, kv: KVCacheManager, rid: str, tokens: list[int], salt: bytes = b"") -> RouteDecision:
    return router.route(rid, kv.page_keys(tokens, salt), salt)


PROMPT = list(range(100, 117))            # 4 full pages + 1 token


def test_a_cached_prefix_draws_its_request_to_the_engine_that_holds_it() -> None:
    kvs = engines(3)
    cache_prompt(kvs[2], 1, PROMPT)
    router = Router(kvs, PAGE)
    got = route(router, kvs[0], "a", PROMPT[:13] + [7, 7, 7])
    assert (got.engine, got.reason, got.matched_tokens) == (2, "affinity", 12)
    router.check_integrity()


def test_no_cached_prefix_goes_to_the_least_loaded_and_fills_evenly() -> None:
    kvs = engines(3)
    router = Router(kvs, PAGE, track_in_flight=False)
    picks = [route(router, kvs[0], f"r{i}", [i] * 9) for i in range(6)]
    assert [p.engine for p in picks] == [0, 1, 2, 0, 1, 2]
    assert {p.reason for p in picks} == {"least_loaded"}
    router.release("r1")
    assert route(router, kvs[0], "next", [99] * 9).engine == 1
    router.check_integrity()


def test_a_burst_of_one_prefix_stays_on_one_engine_before_any_prefill() -> None:
    kvs = engines(2)
    router = Router(kvs, PAGE)
    first = route(router, kvs[0], "p0", PROMPT)
    later = [route(router, kvs[0], f"p{i}", PROMPT[:16] + [i]) for i in range(1, 5)]
    assert {d.engine for d in later} == {first.engine}
    assert {d.reason for d in later} == {"affinity"}
    router.release("p0")
    for i in range(1, 5):
        router.release(f"p{i}")
    assert router.loads() == (0, 0)
    # with nothing in flight and nothing cached, the prompt attracts no engine any more
    assert route(router, kvs[0], "after", PROMPT).reason == "least_loaded"
    router.check_integrity()


def test_without_the_in_flight_record_a_burst_spreads() -> None:
    kvs = engines(2)
    router = Router(kvs, PAGE, track_in_flight=False)
    assert {route(router, kvs[0], f"p{i}", PROMPT).engine for i in range(4)} == {0, 1}


def test_an_overloaded_holder_gives_way_to_the_least_loaded() -> None:
    kvs = engines(2)
    cache_prompt(kvs[0], 1, PROMPT)
    router = Router(kvs, PAGE, RouterSettings(balance_abs=2, balance_ratio=1.5), track_in_flight=False)
    reasons = [route(router, kvs[0], f"r{i}", PROMPT) for i in range(4)]
    # loads before each: (0,0) (1,0) (2,0) (3,0): the third exceeds 0 + 2 and 1.5 x 0
    assert [(d.engine, d.reason) for d in reasons] == [(0, "affinity"), (0, "affinity"), (0, "affinity"),
                                                        (1, "balance")]


def test_the_salt_is_part_of_the_routing_key() -> None:
    kvs = engines(2)
    cache_prompt(kvs[1], 1, PROMPT, salt=b"tenant-a")
    router = Router(kvs, PAGE)
    assert route(router, kvs[0], "a", PROMPT, b"tenant-a").engine == 1
    other = route(router, kvs[0], "b", PROMPT, b"tenant-b")
    assert (other.engine, other.reason, other.matched_tokens) == (0, "least_loaded", 0)
    # the in-flight record is salted too: tenant-b's prompt does not pull tenant-a's request
    assert route(router, kvs[0], "c", PROMPT, b"tenant-a").engine == 1


def test_round_robin_ignores_the_caches() -> None:
    kvs = engines(2)
    cache_prompt(kvs[1], 1, PROMPT)
    router = Router(kvs, PAGE, RouterSettings(policy="round_robin"))
    assert [route(router, kvs[0], f"r{i}", PROMPT).engine for i in range(4)] == [0, 1, 0, 1]


def test_reroute_moves_the_load_and_the_record() -> None:
    kvs = engines(2)
    router = Router(kvs, PAGE)
    assert route(router, kvs[0], "a", PROMPT).engine == 0
    router.reroute("a", 1)
    assert router.loads() == (0, 1) and router.engine_of("a") == 1
    assert route(router, kvs[0], "b", PROMPT).engine == 1
    router.check_integrity()


@pytest.mark.parametrize("bad, field", [({"policy": "random"}, "routing_policy"),
                                        ({"balance_abs": -1}, "routing_balance_abs"),
                                        ({"balance_ratio": 0.5}, "routing_balance_ratio"),
                                        ({"min_match_tokens": 0}, "routing_min_match_tokens")])
def test_bad_settings_name_the_field(bad, field) -> None:
    with pytest.raises(ValueError, match=field):
        RouterSettings(**bad)


ops = st.lists(st.tuples(st.sampled_from(["route", "release", "cache"]), st.integers(0, 5),
                         st.integers(0, 2), st.sampled_from([b"", b"s"])), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, n=st.integers(1, 4), balance_abs=st.integers(0, 4), ratio=st.sampled_from([1.0, 1.5, 3.0]),
       track=st.booleans())
def test_every_decision_respects_the_imbalance_bound_and_prefers_the_holder(ops, n, balance_abs, ratio, track) -> None:
    """Random routes, releases and cached prompts over n engines. Each decision: the chosen engine's
    load is at most max(min + abs, ratio x min); an affinity holds the most tokens of any engine
    (never fewer than a page); a salt never sees another salt's pages."""
    kvs = engines(n, pages=256)
    prompts = [[1000 * p + t for t in range(9)] + [p] * (4 * p) for p in range(6)]
    router = Router(kvs, PAGE, RouterSettings(balance_abs=balance_abs, balance_ratio=ratio), track_in_flight=track)
    live: list[str] = []
    where: dict[str, tuple[int, tuple[bytes, int]]] = {}             # route id -> (engine, (salt, prompt))
    cached: list[set[tuple[bytes, int]]] = [set() for _ in range(n)]  # shadow: what each engine ever cached
    seq = 0
    for i, (op, p, e, salt) in enumerate(ops):
        if op == "cache":
            seq += 1
            cache_prompt(kvs[e % n], seq, prompts[p], salt)
            cached[e % n].add((salt, p))
        elif op == "release" and live:
            router.release(live.pop(p % len(live)))
        else:
            keys = kvs[0].page_keys(prompts[p], salt)
            d = router.route(f"r{i}", keys, salt)
            low = min(d.loads)
            assert d.loads[d.engine] <= max(low + balance_abs, ratio * low)
            indexed = [kv.probe_cached_tokens(keys, salt) for kv in kvs]
            if d.reason == "affinity":
                assert d.matched_tokens >= PAGE and d.matched_tokens >= max(indexed)
                # only the same prompt under the same salt shares a page: it is cached or in flight there
                in_flight = {where[r][1] for r in live if where[r][0] == d.engine} if track else set()
                assert (salt, p) in cached[d.engine] | in_flight
            live.append(f"r{i}")
            where[f"r{i}"] = (d.engine, (salt, p))
        router.check_integrity()
    assert sum(router.loads()) == len(live)


def test_probing_from_another_thread_while_the_engine_caches_and_evicts() -> None:
    """The router probes from Triton's thread while the engine thread registers and evicts pages."""
    kv = KVCacheManager(24, PAGE)
    rng = random.Random(3)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(5, 40))] for _ in range(30)]
    keys = [kv.page_keys(p, b"") for p in prompts]
    stop = threading.Event()
    errors: list[BaseException] = []

    def probe_loop() -> None:
        try:
            while not stop.is_set():
                for k in keys:
                    assert 0 <= kv.probe_cached_tokens(k, b"") <= len(k) * PAGE
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=probe_loop)
    thread.start()
    try:
        for i in range(600):
            cache_prompt(kv, i, prompts[i % len(prompts)])   # a 24-page pool: registrations evict
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    kv.check_integrity()
