"""The engine without a server, on a tiny random Llama: continuous batching, sharing, and that every
exit path returns the request's pages (free + active + cached == total, active == 0 when idle)."""
from __future__ import annotations

import pytest
import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.engine.outputs import InvalidRequest
from kvshare.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_engine(**kw) -> LLMEngine:
    cfg = dict(model="dummy:tiny-llama", num_pages=64, page_size=4, max_running=8, max_step_tokens=64,
               max_prefill_chunk=16, debug_checks=True)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def run_all(engine: LLMEngine, max_steps: int = 1000) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not engine.has_work
    return outs


def tokens(outs) -> tuple[int, ...]:
    return tuple(t for o in outs for t in o.token_ids)


def assert_idle(engine: LLMEngine) -> None:
    s = engine.stats().pool
    assert s.active == 0 and s.free + s.cached == s.total
    engine.check_integrity()


def prompts(n: int, length: int = 10) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 250, (length + i,), generator=g).tolist() for i in range(n)]


def test_batched_equals_one_at_a_time():
    ps = prompts(6)
    solo = []
    for i, p in enumerate(ps):
        e = make_engine()
        e.add_request(str(i), p, GREEDY)
        solo.append(tokens(run_all(e)[str(i)]))
    e = make_engine()
    for i, p in enumerate(ps):
        e.add_request(str(i), p, GREEDY)
    together = run_all(e)
    assert [tokens(together[str(i)]) for i in range(6)] == solo
    assert all(len(t) == 12 for t in solo)
    assert_idle(e)


@pytest.mark.parametrize("page_size,chunk", [(1, 3), (4, 16), (16, 5)])
def test_page_size_and_chunking_do_not_change_output(page_size, chunk):
    p = prompts(1, 23)[0]
    ref = make_engine()
    ref.add_request("r", p, GREEDY)
    expected = tokens(run_all(ref)["r"])
    e = make_engine(page_size=page_size, num_pages=256 // page_size + 8, max_prefill_chunk=chunk)
    e.add_request("r", p, GREEDY)
    assert tokens(run_all(e)["r"]) == expected


def test_shared_prefix_is_served_from_cache_with_identical_output():
    p = prompts(1, 21)[0]
    e = make_engine()
    e.add_request("a", p, GREEDY)
    first = run_all(e)["a"]
    e.add_request("b", p, GREEDY)
    second = run_all(e)["b"]
    assert tokens(first) == tokens(second)
    assert second[-1].cached_tokens == 20          # all but the last prompt token (its logits are needed)
    e.add_request("c", p, GREEDY, cache_salt="other tenant")
    assert run_all(e)["c"][-1].cached_tokens == 0
    assert_idle(e)


def test_every_exit_path_returns_pages():
    e = make_engine()
    ps = prompts(5)
    e.add_request("length", ps[0], GREEDY)
    e.add_request("cancel-waiting", ps[1], GREEDY)
    e.add_request("cancel-running", ps[2], GREEDY)
    e.add_request("eos", ps[3], SamplingParams(max_tokens=50, temperature=1.0, seed=3))
    e.abort("cancel-waiting")
    for _ in range(3):
        e.step()
    final = e.abort("cancel-running")
    assert final.finished and final.finish_reason == "cancelled"
    assert e.abort("cancel-running") is None      # idempotent
    run_all(e)
    assert_idle(e)


def test_preemption_when_the_pool_runs_dry_still_completes_everything():
    # 6 requests x (10 prompt + 30 new) tokens = 240 tokens > 24 pages x 4 tokens.
    e = make_engine(num_pages=24, max_running=6)
    ps = prompts(6)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ps):
        e.add_request(str(i), p, params)
    outs = run_all(e, max_steps=5000)
    assert e.stats().pool.preemptions_total > 0
    for i, p in enumerate(ps):
        solo = make_engine(num_pages=64)
        solo.add_request("x", p, params)
        assert tokens(outs[str(i)]) == tokens(run_all(solo)["x"])
    assert_idle(e)


def test_request_larger_than_the_pool_is_rejected_up_front():
    e = make_engine(num_pages=8)                  # 32 tokens of KV in all
    with pytest.raises(InvalidRequest) as err:
        e.add_request("big", list(range(3, 23)), SamplingParams(max_tokens=20))
    assert err.value.field == "max_tokens" and "whole page pool" in str(err.value)
    assert_idle(e)


@pytest.mark.parametrize("prompt,params,field", [
    ([], GREEDY, "input_ids"), ([3, 999_999], GREEDY, "input_ids"), ([3] * 600, GREEDY, "input_ids"),
    ([3, 4], SamplingParams(max_tokens=0), "max_tokens"), ([3, 4], SamplingParams(max_tokens=10_000), "max_tokens"),
    ([3, 4], SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
])
def test_validation_names_the_field(prompt, params, field):
    e = make_engine(num_pages=1024)
    with pytest.raises(InvalidRequest) as err:
        e.validate(prompt, params)
    assert err.value.field == field


def test_engine_error_ends_all_requests_and_frees_pages(monkeypatch):
    from kvshare.engine.engine_loop import EngineLoop, Submission
    import queue

    e = make_engine()
    got: queue.SimpleQueue = queue.SimpleQueue()
    calls = {"n": 0}
    real = e.runner.execute

    def flaky(chunks):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real(chunks)

    monkeypatch.setattr(e.runner, "execute", flaky)
    loop = EngineLoop(e)
    try:
        for i, p in enumerate(prompts(3)):
            loop.submit(Submission(str(i), p, GREEDY, "", False, got.put, None))
        finals = {}
        while len(finals) < 3:
            o = got.get(timeout=30)
            if o.finished:
                finals[o.request_id] = o
        assert {o.finish_reason for o in finals.values()} <= {"error", "length"}
        assert any(o.finish_reason == "error" and "simulated" in o.error for o in finals.values())
        loop.call(assert_idle)
        loop.submit(Submission("after", prompts(1)[0], GREEDY, "", False, got.put, None))
        while True:
            o = got.get(timeout=30)
            if o.finished:
                break
        assert o.finish_reason == "length"
    finally:
        loop.shutdown()


def test_engine_loop_refuses_past_its_in_flight_limit_and_recovers():
    from kvshare.engine.engine_loop import EngineLoop, Submission
    import queue

    e = make_engine()
    got: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(e, max_in_flight=2)
    try:
        long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        ps = prompts(3)
        assert loop.try_submit(Submission("a", ps[0], long, "", False, got.put, None))
        assert loop.try_submit(Submission("b", ps[1], long, "", False, got.put, None))
        assert not loop.try_submit(Submission("c", ps[2], long, "", False, got.put, None))
        finished = set()
        while len(finished) < 2:
            o = got.get(timeout=60)
            if o.finished:
                finished.add(o.request_id)
        assert finished == {"a", "b"} and loop.in_flight == 0
        assert loop.try_submit(Submission("c", ps[2], long, "", False, got.put, None))
        while not got.get(timeout=60).finished:
            pass
        assert loop.in_flight == 0
        loop.call(assert_idle)
    finally:
        loop.shutdown()
