"""Faults inside the engine (engine/faults.py): a forward step, the sampler or the detokenizer that
raises ends every request in flight with one error final, its pages return, and the loop goes on
serving. Also the loop's own backstops: a final lost with a failed step, request timeouts, and the
drain once the server stops serving. Real engine (dummy weights, SmolLM2's tokenizer for text) on
the CPU, and EngineLoop's fake engine where a step must fail in a precise way."""
from __future__ import annotations

import queue
import time

import pytest
from test_engine_loop_delivery import FakeEngine

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.engine.engine_loop import EngineLoop, Submission
from kvshare.engine.faults import FaultInjector, FaultRule, FaultSpec, InjectedFault
from kvshare.engine.outputs import RequestOutput
from kvshare.sampling_params import SamplingParams

PROMPTS = [[11, 23, 35, 47, 59, 61, 73], [12, 24, 36, 48], [13, 25, 37, 49, 51, 63, 75, 87, 99, 101]]


# -- the switch -------------------------------------------------------------------------------------
def test_the_spec_parses_every_site_limit_duration_and_seed():
    spec = FaultSpec.parse("forward:0.1, sample:1:2,detokenize:0.05,pump:1:1,slow_step:200ms,seed:7")
    assert spec.rules == {"forward": FaultRule(0.1), "sample": FaultRule(1.0, 2), "detokenize": FaultRule(0.05),
                          "pump": FaultRule(1.0, 1)}
    assert spec.slow_step_s == pytest.approx(0.2) and spec.seed == 7 and spec.active
    assert FaultSpec.parse("slow_step:0.5s").slow_step_s == pytest.approx(0.5)


@pytest.mark.parametrize("text, names", [("forwrd:1", "forwrd:1"), ("forward:2", "forward:2"),
                                         ("pump:1:0", "pump:1:0"), ("slow_step:200", "slow_step:200"),
                                         ("sample:x", "sample:x")])
def test_a_bad_spec_is_an_error_naming_the_item(text, names):
    with pytest.raises(ValueError, match=f"KVSHARE_FAULTS item '{names}'"):
        FaultSpec.parse(text)


def test_unset_builds_nothing():
    assert FaultInjector.from_environment({}) is None
    assert FaultInjector.from_environment({"KVSHARE_FAULTS": " "}) is None
    assert FaultInjector.from_environment({"KVSHARE_FAULTS": "forward:0.5"}) is not None


def test_max_fires_and_seeded_draws():
    f = FaultInjector(FaultSpec.parse("forward:1:2"))
    fired = 0
    for _ in range(5):
        try:
            f.check("forward")
        except InjectedFault:
            fired += 1
    assert fired == 2 and f.fired["forward"] == 2
    f.check("sample")           # a site without a rule never fires

    def draws(seed):
        g = FaultInjector(FaultSpec.parse(f"pump:0.5,seed:{seed}"))
        out = []
        for _ in range(40):
            try:
                g.check("pump")
                out.append(0)
            except InjectedFault:
                out.append(1)
        return out
    assert draws(3) == draws(3) and 0 < sum(draws(3)) < 40


# -- the real engine --------------------------------------------------------------------------------
def make_engine(faults: str, **kw) -> LLMEngine:
    cfg = dict(model="dummy:tiny-llama", num_pages=64, page_size=4, max_running=8, max_step_tokens=64,
               max_prefill_chunk=16, debug_checks=True)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), faults=FaultInjector(FaultSpec.parse(faults)))


def assert_idle(engine: LLMEngine) -> None:
    s = engine.stats().pool
    assert s.active == 0 and s.free + s.cached == s.total, s
    engine.check_integrity()


def run_through_loop(engine: LLMEngine, prompts, max_tokens: int = 12) -> dict[str, list[RequestOutput]]:
    """Submits every prompt at once and collects each request's outputs until its final."""
    got: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        loop.try_submit_all([Submission(f"r{i}", p, params, "", False, got.put, None) for i, p in enumerate(prompts)])
        outs: dict[str, list[RequestOutput]] = {}
        while sum(1 for o in outs.values() if o[-1].finished) < len(prompts):
            o = got.get(timeout=60)
            outs.setdefault(o.request_id, []).append(o)
        loop.call(lambda e: None)          # every output of the engine thread has been delivered
        assert got.empty(), "nothing after a final"
    finally:
        loop.shutdown()
    return outs


# Overlap scheduling launches greedy steps without the host sampler (the argmax stays on the
# device), so the sample site is reached on the synchronous path only.
@pytest.mark.parametrize("site, overlap", [("forward", False), ("forward", True), ("sample", False)])
def test_a_failing_step_ends_every_request_with_one_error_and_frees_its_pages(site, overlap):
    engine = make_engine(f"{site}:1:1", overlap_schedule=overlap)
    outs = run_through_loop(engine, PROMPTS)
    for rid, seq in outs.items():
        finals = [o for o in seq if o.finished]
        assert len(finals) == 1 and finals[0] is seq[-1], rid
        assert finals[0].finish_reason == "error" and f"injected {site} fault #1" in finals[0].error
    assert_idle(engine)
    # the engine goes on serving: the fault fired once, the next requests run to their end
    again = run_through_loop(engine, PROMPTS)
    assert all(seq[-1].finish_reason == "length" and seq[-1].num_output_tokens == 12 for seq in again.values())
    assert_idle(engine)


def test_a_failing_step_in_mid_generation_keeps_the_tokens_already_streamed():
    # seed 3: the sixth draw is the first below 0.2, so the fault hits the sixth step
    engine = make_engine("forward:0.2:1,seed:3")
    outs = run_through_loop(engine, PROMPTS, max_tokens=40)
    assert all(seq[-1].finish_reason == "error" for seq in outs.values())
    assert any(len(seq) > 1 for seq in outs.values()), "the fault came after the first tokens"
    assert_idle(engine)


def test_a_failing_detokenizer_ends_the_requests_and_frees_their_pages(tokenizer):
    import dataclasses

    import torch

    from kvshare.runtime.weights import load_model

    # dummy weights with SmolLM2's tokenizer: its ids < 256 decode, so the detokenizer runs
    loaded = dataclasses.replace(load_model("dummy:tiny-llama", dtype=torch.float32, device=torch.device("cpu"), seed=0),
                                 tokenizer=tokenizer)
    cfg = EngineConfig(model="dummy:tiny-llama", num_pages=64, page_size=4, max_running=8, max_step_tokens=64,
                       max_prefill_chunk=16, debug_checks=True)
    engine = LLMEngine(cfg, loaded, faults=FaultInjector(FaultSpec.parse("detokenize:1:1")))
    assert engine.tokenizer is not None
    outs = run_through_loop(engine, PROMPTS)
    assert all(seq[-1].finish_reason == "error" and "detokenize" in seq[-1].error for seq in outs.values())
    assert_idle(engine)
    again = run_through_loop(engine, PROMPTS)
    assert all(seq[-1].finish_reason == "length" for seq in again.values())
    assert_idle(engine)


def test_a_slow_step_only_delays():
    engine = make_engine("slow_step:5ms")
    outs = run_through_loop(engine, PROMPTS, max_tokens=6)
    assert all(seq[-1].finish_reason == "length" and seq[-1].num_output_tokens == 6 for seq in outs.values())
    assert_idle(engine)


def test_a_timeout_ends_a_running_request_with_an_error_and_frees_its_pages():
    engine = make_engine("slow_step:20ms", num_pages=256)
    got: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine)
    try:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        loop.submit(Submission("slow", PROMPTS[0], params, "", False, got.put, None, timeout_s=0.3))
        loop.submit(Submission("free", PROMPTS[1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                               "", False, got.put, None))
        finals = {}
        while len(finals) < 2:
            o = got.get(timeout=60)
            if o.finished:
                finals[o.request_id] = o
        loop.call(lambda e: None)
        assert loop.in_flight == 0
    finally:
        loop.shutdown()
    assert finals["free"].finish_reason == "length"
    slow = finals["slow"]
    assert slow.finish_reason == "error" and "timeout" in slow.error and "300 ms" in slow.error
    assert slow.num_output_tokens < 400
    assert_idle(engine)


# -- the loop's backstops (fake engine) ---------------------------------------------------------------
class LosingEngine(FakeEngine):
    """A step that finishes request "a" (its final output built, the request dropped) and then
    raises: the final is lost with the step, as when a later request's detokenizer fails."""

    def step(self):
        if "a" in self.running and "b" in self.running:
            del self.running["a"]
            raise RuntimeError("boom after a finished")
        return super().step()


def test_a_final_lost_with_a_failed_step_is_replaced_by_an_error():
    engine = LosingEngine()
    got: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine)
    try:
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        loop.try_submit_all([Submission(r, [1, 2], params, "", False, got.put, None) for r in "ab"])
        finals = {}
        while len(finals) < 2:
            o = got.get(timeout=10)
            if o.finished:
                finals[o.request_id] = o
        assert finals["a"].finish_reason == "error" and "boom" in finals["a"].error
        assert finals["b"].finish_reason == "error"
        assert loop.in_flight == 0
        loop.submit(Submission("c", [1], SamplingParams(max_tokens=2, ignore_eos=True), "", False, got.put, None))
        assert [got.get(timeout=10).finish_reason for _ in range(2)][-1] == "length"
    finally:
        loop.shutdown()


class RaisingAbortEngine(FakeEngine):
    def abort(self, rid, reason="cancelled", error=None):
        raise RuntimeError("abort is broken")


def test_the_engine_thread_survives_a_cancel_that_raises():
    engine = RaisingAbortEngine()
    got: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine)
    try:
        loop.submit(Submission("a", [1], SamplingParams(max_tokens=10_000, ignore_eos=True), "", False, got.put, None))
        got.get(timeout=10)
        loop.cancel("a")
        while not (o := got.get(timeout=10)).finished:
            pass
        assert o.request_id == "a" and o.finish_reason == "error" and "abort is broken" in o.error
        engine.running.clear()
        loop.submit(Submission("b", [1], SamplingParams(max_tokens=2, ignore_eos=True), "", False, got.put, None))
        while not (o := got.get(timeout=10)).finished:
            pass
        assert o.request_id == "b" and o.finish_reason == "length"
    finally:
        loop.shutdown()


def test_once_the_server_stops_serving_every_request_ends_and_new_ones_are_refused():
    answers = [True, True, False, True]      # the first "no" drains, and no readiness call follows it
    asked = []

    def serving():
        asked.append(1)
        return answers[min(len(asked), len(answers)) - 1]

    engine = FakeEngine(step_s=0.005)
    got: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine, cancel_poll_s=0.01, serving=serving, serving_poll_s=0.02)
    try:
        params = SamplingParams(max_tokens=100_000, ignore_eos=True)
        loop.try_submit_all([Submission(r, [1], params, "", False, got.put, None) for r in "ab"])
        finals = {}
        while len(finals) < 2:
            o = got.get(timeout=10)
            if o.finished:
                finals[o.request_id] = o
        assert {o.finish_reason for o in finals.values()} == {"cancelled"}
        time.sleep(0.1)
        assert len(asked) == 3
        assert all("shutting down" in o.error for o in finals.values())
        assert loop.draining and not loop.try_submit(Submission("c", [1], params, "", False, got.put, None))
        assert loop.in_flight == 0 and not engine.running
    finally:
        loop.shutdown()


def test_no_drain_while_the_server_cannot_tell():
    engine = FakeEngine(step_s=0.005)
    got: queue.SimpleQueue = queue.SimpleQueue()
    # None: cannot tell (before the first execute, a probe that timed out); yes. A single "no"
    # drains, so none comes here.
    answers = iter([None, True, None, None, True] + [True] * 10_000)
    loop = EngineLoop(engine, cancel_poll_s=0.01, serving=lambda: next(answers), serving_poll_s=0.01)
    try:
        loop.submit(Submission("a", [1], SamplingParams(max_tokens=60, ignore_eos=True), "", False, got.put, None))
        while not (o := got.get(timeout=10)).finished:
            pass
        assert o.finish_reason == "length" and not loop.draining
    finally:
        loop.shutdown()


def test_an_abandoned_request_is_never_probed_again_and_ends():
    """The pump sends an abandoned request's final itself: no probe may run after abandon() returns."""
    probed_after = []
    abandoned = False

    def probe():
        if abandoned:
            probed_after.append(1)
        return False

    engine = FakeEngine(step_s=0.002)
    got: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine, cancel_poll_s=0.001)
    try:
        loop.submit(Submission("a", [1], SamplingParams(max_tokens=100_000, ignore_eos=True), "", False, got.put, probe))
        got.get(timeout=10)
        loop.abandon("a")
        abandoned = True
        while not (o := got.get(timeout=10)).finished:
            pass
        assert o.finish_reason == "cancelled" and loop.in_flight == 0
        loop.call(lambda e: None)
    finally:
        loop.shutdown()
    assert probed_after == []
