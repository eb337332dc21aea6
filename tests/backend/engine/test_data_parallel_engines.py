"""EngineGroup: real engines (tiny dummy model on the CPU) behind the router, each on its own
thread: a repeated prefix lands on the engine that computed it and is served from its pool; the
other engine's counters stay untouched; salts, round robin, cancel, refusal when every engine is
full, and the same greedy tokens whichever engine serves a prompt."""
from __future__ import annotations

import dataclasses
import queue
import time

import pytest

from kvshare.core.router import RouterSettings
from kvshare.engine.data_parallel import EngineGroup, ParallelConfig, build_engines
from kvshare.engine.engine_config import EngineConfig
from kvshare.engine.engine_loop import Submission
from kvshare.sampling_params import SamplingParams

CONFIG = EngineConfig(model="dummy:tiny-llama", num_pages=64, page_size=4, max_running=8, max_step_tokens=64,
                      max_prefill_chunk=32, debug_checks=True)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PREFIX = [(7 * i) % 250 + 3 for i in range(24)]       # 6 full pages of 4


def make_group(n: int = 2, policy: str = "cache_aware", max_in_flight: int | None = None) -> EngineGroup:
    engines = build_engines(CONFIG, ParallelConfig(data_parallel_size=n))
    return EngineGroup(engines, RouterSettings(policy=policy), max_in_flight=max_in_flight)


def run(group: EngineGroup, rid: str, prompt: list[int], salt: str = "", params: SamplingParams = GREEDY,
        timeout: float = 60.0):
    """Submits one request and waits for its final output; returns (decision, final output, tokens)."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    decision = group.try_submit_all(rid, [Submission(rid, prompt, params, salt, False, q.put, None)])
    assert decision is not None
    tokens = []
    deadline = time.monotonic() + timeout
    while True:
        out = q.get(timeout=max(0.1, deadline - time.monotonic()))
        tokens += out.token_ids
        if out.finished:
            return decision, out, tokens


def wait_released(group: EngineGroup, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(group.router.loads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert group.router.loads() == (0,) * len(group.engines)


@pytest.fixture
def group():
    g = make_group()
    yield g
    g.shutdown()


def test_engines_share_one_copy_of_the_weights_on_the_cpu(group) -> None:
    a, b = group.engines
    assert a.scheduler is not b.scheduler and a.kv is not b.kv
    assert a.runner.model.weights is b.runner.model.weights


def test_a_repeated_prefix_lands_on_the_engine_that_holds_it(group) -> None:
    first, out1, want = run(group, "a", PREFIX + [11, 12])
    wait_released(group)
    second, out2, got = run(group, "b", PREFIX + [13, 14])
    assert first.reason == "least_loaded" and out1.cached_tokens == 0
    assert (second.engine, second.reason) == (first.engine, "affinity")
    assert second.matched_tokens == len(PREFIX) and out2.cached_tokens == len(PREFIX)
    holder, other = group.engines[first.engine], group.engines[1 - first.engine]
    assert holder.stats().pool.prefix_hits_tokens_total == len(PREFIX)
    assert other.stats().prompt_tokens_total == 0
    # a different prompt goes to the idle one
    third, _, _ = run(group, "c", [200 + i for i in range(10)])
    wait_released(group)
    assert third.engine == 1 - first.engine
    for engine in group.engines:
        engine.check_integrity()
    group.router.check_integrity()


def test_the_salt_keeps_prefixes_apart_across_engines(group) -> None:
    first, _, _ = run(group, "a", PREFIX + [1], salt="tenant-a")
    wait_released(group)
    other, out, _ = run(group, "b", PREFIX + [1], salt="tenant-b")
    assert other.reason == "least_loaded" and out.cached_tokens == 0
    assert other.engine != first.engine      # the least loaded of two idle engines, in turn


def test_either_engine_gives_the_same_greedy_tokens() -> None:
    g = make_group(policy="round_robin")
    try:
        picks = [run(g, f"r{i}", PREFIX + [5], salt=f"s{i}") for i in range(2)]
    finally:
        g.shutdown()
    assert {d.engine for d, _, _ in picks} == {0, 1}
    assert picks[0][2] == picks[1][2] and len(picks[0][2]) == GREEDY.max_tokens


def test_a_full_engine_hands_the_request_to_another_and_all_full_refuses() -> None:
    g = make_group(max_in_flight=1)
    slow = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    q: queue.SimpleQueue = queue.SimpleQueue()
    try:
        subs = [Submission(f"r{i}", PREFIX + [i], slow, "", False, q.put, None) for i in range(3)]
        d0 = g.try_submit_all("r0", [subs[0]])
        d1 = g.try_submit_all("r1", [subs[1]])          # the prefix pulls it to r0's engine, which is full
        assert d0 is not None and d1 is not None and d1.engine != d0.engine
        assert g.try_submit_all("r2", [subs[2]]) is None
        assert g.router.loads() == (1, 1)
        g.cancel("r0")
        g.cancel("r1")
        finals = set()
        while len(finals) < 2:
            out = q.get(timeout=30)
            if out.finished:
                finals.add((out.request_id, out.finish_reason))
        assert finals == {("r0", "cancelled"), ("r1", "cancelled")}
        wait_released(g)
        g.router.check_integrity()
    finally:
        g.shutdown()


def test_parallel_config_reads_devices_and_refuses_bad_values() -> None:
    assert ParallelConfig(data_parallel_size=2).engine_devices("cuda:0") == ("cuda:0", "cuda:1")
    # data parallel x tensor parallel: engine i's ranks on cuda:iT .. cuda:iT+T-1
    assert ParallelConfig(data_parallel_size=2).engine_devices("cuda:0", 4) == ("cuda:0", "cuda:4")
    assert ParallelConfig(data_parallel_size=2).engine_devices("cpu") == ("cpu", "cpu")
    assert ParallelConfig.from_mapping({"data_parallel_size": "2", "devices": "cuda:1, cuda:3",
                                        "max_running": "9"}).device_list == ("cuda:1", "cuda:3")
    with pytest.raises(ValueError, match="devices lists 1 devices"):
        ParallelConfig(data_parallel_size=2, devices="cuda:0")
    with pytest.raises(ValueError, match="routing_policy"):
        ParallelConfig(routing_policy="random")
    with pytest.raises(ValueError, match="data_parallel_size"):
        ParallelConfig.from_mapping({"data_parallel_size": "two"})


def test_two_tensor_parallel_engines_behind_the_router_give_the_one_rank_tokens() -> None:
    """data_parallel_size 2 x tensor_parallel_size 2: each engine's two ranks (rank 0 here, one
    spawned follower) form their own process group, so one process drives both engines; a repeated
    prefix still lands on the engine that holds it, and the tokens are the single engine's."""
    single = make_group(1)
    try:
        _, _, want = run(single, "w", PREFIX + [1, 2])
    finally:
        single.shutdown()
    engines = build_engines(dataclasses.replace(CONFIG, tensor_parallel_size=2), ParallelConfig(data_parallel_size=2))
    group = EngineGroup(engines, RouterSettings())
    try:
        first, _, got = run(group, "a", PREFIX + [1, 2])
        again, out, got_again = run(group, "b", PREFIX + [1, 2])
        assert got == got_again == want
        assert again.engine == first.engine and out.cached_tokens >= len(PREFIX)
        run(group, "c", [9, 8, 7, 6, 5, 4])
        wait_released(group)
        for engine in group.engines:
            engine.check_integrity()
    finally:
        group.shutdown()
