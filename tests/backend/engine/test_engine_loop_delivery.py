"""EngineLoop's delivery: a batch sink gets each step's outputs as one list, and cancellation probes
run on the watcher thread (in the Triton stub each probe is an IPC round trip), never on the engine's."""
from __future__ import annotations

import queue
import threading
import time

import pytest

from kvshare.engine.engine_loop import EngineLoop, Submission
from kvshare.engine.outputs import RequestOutput
from kvshare.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


class FakeEngine:
    """One token per running request per step, `max_tokens` of them; records the thread of each call."""

    def __init__(self, step_s: float = 0.0):
        self.running: dict[str, list] = {}
        self.step_s = step_s
        self.threads: set[str] = set()

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def request_ids(self):
        return list(self.running)

    def add_request(self, rid, prompt_ids, params, *, cache_salt="", echo_prompt=False, fork_of=None):
        self.running[rid] = [params.max_tokens, 0]

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        if self.step_s:
            time.sleep(self.step_s)
        outs = []
        for rid, st in list(self.running.items()):
            st[1] += 1
            done = st[1] >= st[0]
            outs.append(RequestOutput(rid, (st[1],), str(st[1]), done, "length" if done else None, 3, st[1], 0))
            if done:
                del self.running[rid]
        return outs

    def abort(self, rid, reason="cancelled", error=None):
        st = self.running.pop(rid, None)
        return None if st is None else RequestOutput(rid, (), "", True, reason, 3, st[1], 0, error)

    def abort_all(self, reason, error=None):
        return [self.abort(rid, reason, error) for rid in list(self.running)]


def collect_until_final(q: queue.SimpleQueue, n_requests: int, timeout: float = 10.0) -> list:
    items, finals = [], set()
    deadline = time.monotonic() + timeout
    while len(finals) < n_requests:
        item = q.get(timeout=max(0.01, deadline - time.monotonic()))
        items.append(item)
        for o in (item if isinstance(item, list) else [item]):
            if o.finished:
                finals.add(o.request_id)
    return items


def test_a_batch_sink_gets_one_list_per_step_with_every_request():
    engine = FakeEngine()
    batches: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine)
    try:
        # Submitted while the loop is idle: the first step sees all three.
        for rid in "abc":
            loop.submit(Submission(rid, [1, 2, 3], PARAMS, "", False, None, None, batch_sink=batches.put))
        got = collect_until_final(batches, 3)
    finally:
        loop.shutdown()
    per_request: dict[str, list] = {}
    for batch in got:
        assert isinstance(batch, list) and batch
        rids = [o.request_id for o in batch]
        assert len(rids) == len(set(rids)), "one output per request per step"
        for o in batch:
            per_request.setdefault(o.request_id, []).append(o)
    assert sorted(per_request) == ["a", "b", "c"]
    for outs in per_request.values():
        assert [o.token_ids for o in outs] == [(1,), (2,), (3,), (4,), (5,)]
        assert [o.finished for o in outs] == [False] * 4 + [True]
    assert loop.in_flight == 0


def test_batch_sinks_and_plain_sinks_side_by_side():
    engine = FakeEngine()
    a_batches: queue.SimpleQueue = queue.SimpleQueue()
    b_batches: queue.SimpleQueue = queue.SimpleQueue()
    plain: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine)
    try:
        loop.submit(Submission("a", [1], PARAMS, "", False, plain.put, None, batch_sink=a_batches.put))
        loop.submit(Submission("b", [1], PARAMS, "", False, None, None, batch_sink=b_batches.put))
        loop.submit(Submission("p", [1], PARAMS, "", False, plain.put, None))
        got_a = collect_until_final(a_batches, 1)
        got_b = collect_until_final(b_batches, 1)
        got_p = collect_until_final(plain, 1)
    finally:
        loop.shutdown()
    assert {o.request_id for batch in got_a for o in batch} == {"a"}, "a batch sink replaces the plain sink"
    assert {o.request_id for batch in got_b for o in batch} == {"b"}
    assert [o.request_id for o in got_p] == ["p"] * 5


def test_cancellation_probes_run_on_the_watcher_thread_and_cancel_promptly():
    engine = FakeEngine(step_s=0.002)
    batches: queue.SimpleQueue = queue.SimpleQueue()
    probe_threads: set[str] = set()
    cancel_at = time.monotonic() + 0.2

    def probe() -> bool:
        probe_threads.add(threading.current_thread().name)
        return time.monotonic() >= cancel_at

    loop = EngineLoop(engine, cancel_poll_s=0.02)
    try:
        long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        loop.submit(Submission("a", [1], long, "", False, None, probe, batch_sink=batches.put))
        got = collect_until_final(batches, 1, timeout=10)
    finally:
        loop.shutdown()
    final = [o for batch in got for o in batch if o.finished]
    assert len(final) == 1 and final[0].finish_reason == "cancelled"
    assert time.monotonic() - cancel_at < 5
    assert probe_threads == {"kvshare-cancel-watch"}
    assert "kvshare-engine" in engine.threads and "kvshare-cancel-watch" not in engine.threads
    assert loop.in_flight == 0


def test_a_probe_that_raises_does_not_stop_the_watcher():
    engine = FakeEngine(step_s=0.002)
    batches: queue.SimpleQueue = queue.SimpleQueue()
    calls = {"bad": 0}

    def bad() -> bool:
        calls["bad"] += 1
        raise RuntimeError("the stub is gone")

    loop = EngineLoop(engine, cancel_poll_s=0.01)
    try:
        long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        loop.submit(Submission("bad", [1], long, "", False, None, bad, batch_sink=batches.put))
        loop.submit(Submission("good", [1], long, "", False, None, lambda: calls["bad"] >= 3,
                               batch_sink=batches.put))
        got = collect_until_final(batches, 1, timeout=10)
        assert [o.request_id for batch in got for o in batch if o.finished] == ["good"]
        loop.cancel("bad")
        collect_until_final(batches, 1, timeout=10)
    finally:
        loop.shutdown()
    assert loop.in_flight == 0


def test_a_finished_request_is_no_longer_probed():
    engine = FakeEngine()
    batches: queue.SimpleQueue = queue.SimpleQueue()
    calls = []
    loop = EngineLoop(engine, cancel_poll_s=0.01)
    try:
        loop.submit(Submission("a", [1], PARAMS, "", False, None, lambda: calls.append(1) or False,
                               batch_sink=batches.put))
        collect_until_final(batches, 1)
        time.sleep(0.05)
        n = len(calls)
        time.sleep(0.1)
        assert len(calls) == n
    finally:
        loop.shutdown()


def test_no_probe_runs_once_its_final_output_is_delivered():
    """In the Triton stub the final response frees the request's response factory: a probe that
    starts after it (is_cancelled on freed memory) crashed the server (SIGSEGV in
    TRITONBACKEND_ResponseFactoryIsCancelled). Slow probes widen the window."""
    engine = FakeEngine(step_s=0.001)
    finals: set[str] = set()
    late: list[str] = []

    def sink(out: RequestOutput) -> None:
        if out.finished:
            finals.add(out.request_id)

    def probe(rid: str):
        def is_cancelled() -> bool:
            if rid in finals:
                late.append(rid)
            time.sleep(0.002)
            return False
        return is_cancelled

    loop = EngineLoop(engine, cancel_poll_s=0.001)
    try:
        for i in range(40):
            loop.submit(Submission(f"r{i}", [1], SamplingParams(max_tokens=1 + i % 4, temperature=0.0, ignore_eos=True),
                                   "", False, sink, probe(f"r{i}")))
        deadline = time.monotonic() + 10
        while len(finals) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert len(finals) == 40
        assert not late, f"probed after their final output: {late[:5]}"
    finally:
        loop.shutdown()


def test_shutdown_ends_everything_and_stops_both_threads():
    engine = FakeEngine(step_s=0.001)
    batches: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine, cancel_poll_s=0.01)
    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for rid in "ab":
        loop.submit(Submission(rid, [1], long, "", False, None, lambda: False, batch_sink=batches.put))
    time.sleep(0.05)
    loop.shutdown()
    finals = [o for batch in iter(lambda: batches.get_nowait() if not batches.empty() else None, None)
              for o in batch if o.finished]
    assert sorted(o.request_id for o in finals) == ["a", "b"]
    assert {o.finish_reason for o in finals} == {"cancelled"}
    assert not loop._thread.is_alive() and not loop._watcher.is_alive()


@pytest.mark.parametrize("n", [4])
def test_real_engine_batches_equal_plain_sink_outputs(n):
    from test_engine import make_engine, prompts

    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    ps = prompts(n)

    def run(batch: bool) -> dict[str, list]:
        q: queue.SimpleQueue = queue.SimpleQueue()
        loop = EngineLoop(make_engine())
        try:
            for i, p in enumerate(ps):
                loop.submit(Submission(str(i), p, params, "", False, None if batch else q.put, None,
                                       batch_sink=q.put if batch else None))
            items = collect_until_final(q, n, timeout=60)
        finally:
            loop.shutdown()
        outs: dict[str, list] = {}
        for item in items:
            for o in (item if isinstance(item, list) else [item]):
                outs.setdefault(o.request_id, []).append(o.token_ids)
        return outs

    assert run(batch=True) == run(batch=False)


def test_a_cancel_ends_every_member_of_a_batched_request():
    engine = FakeEngine(step_s=0.001)
    batches: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine, cancel_poll_s=0.01)
    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    subs = [Submission(rid, [1], long, "", False, None, None, batch_sink=batches.put)
            for rid in ("key:k/0.0", "key:k/0.1", "key:k/1.0", "key:other")]
    assert loop.try_submit_all(subs)
    time.sleep(0.05)
    loop.cancel("key:k")
    deadline = time.monotonic() + 5
    finals = {}
    while len(finals) < 3 and time.monotonic() < deadline:
        try:
            batch = batches.get(timeout=0.1)
        except queue.Empty:
            continue
        finals.update({o.request_id: o.finish_reason for o in batch if o.finished})
    assert finals == {"key:k/0.0": "cancelled", "key:k/0.1": "cancelled", "key:k/1.0": "cancelled"}
    assert engine.request_ids() == ["key:other"]
    loop.shutdown()


def test_try_submit_all_takes_all_or_none():
    loop = EngineLoop(FakeEngine(step_s=0.001), max_in_flight=3)
    p = SamplingParams(max_tokens=1_000, temperature=0.0)
    subs = [Submission(f"r{i}", [1], p, "", False, None, None) for i in range(4)]
    assert not loop.try_submit_all(subs)
    assert loop.in_flight == 0
    assert loop.try_submit_all(subs[:3])
    loop.shutdown()
