"""EngineProcessGroup against a real engine process (dummy tiny model on the CPU, no Triton): the
same tokens as an engine here, admission, a probe that fires, a start that fails, a process that
dies, and a shutdown with requests in flight. Every submitted request gets exactly one final."""
from __future__ import annotations

import os
import queue
import signal
import time

import pytest

from kvshare.engine.data_parallel import ParallelConfig
from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.engine.engine_loop import Submission
from kvshare.engine.process_group import EngineProcessGroup, EngineUnavailable
from kvshare.sampling_params import SamplingParams

CONFIG = EngineConfig.from_mapping({"model": "dummy:tiny-llama", "device": "cpu", "num_pages": "64"})
SHORT = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
LONG = SamplingParams(max_tokens=400, min_tokens=400, temperature=0.0)


class Collector:
    def __init__(self):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.tokens: dict[str, list[int]] = {}
        self.finals: dict[str, list] = {}

    def sink(self, outs):
        for out in outs:
            self.q.put(out)

    def until_final(self, rids, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not set(rids) <= set(self.finals):
            out = self.q.get(timeout=max(0.1, deadline - time.monotonic()))
            self.tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                self.finals.setdefault(out.request_id, []).append(out)
        return {rid: self.finals[rid][0] for rid in rids}

    def sub(self, rid, ids, params=SHORT, probe=None):
        return Submission(rid, ids, params, "", False, None, probe, batch_sink=self.sink)


@pytest.fixture
def group():
    ticks = []
    g = EngineProcessGroup.start(CONFIG, ParallelConfig(), max_in_flight=4, on_tick=ticks.append)
    g.ticks = ticks
    yield g
    g.shutdown()


def test_the_engine_process_streams_the_tokens_of_an_engine_here(group):
    prompts = [[1, 2, 3, 4 + i] for i in range(3)]
    c = Collector()
    assert group.try_submit_all("r", [c.sub(f"r{i}", ids) for i, ids in enumerate(prompts)])
    finals = c.until_final(["r0", "r1", "r2"])
    engine = LLMEngine(CONFIG)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SHORT)
    here: dict[str, list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            here.setdefault(out.request_id, []).extend(out.token_ids)
    assert c.tokens == here
    assert {f.finish_reason for f in finals.values()} == {"length"} and group.in_flight == 0
    assert group.ready.limits == engine.limits and group.ready.num_pages == 64
    assert group.ticks and group.ticks[0].stats.pool.total == 64


def test_admission_is_decided_here_and_a_probe_that_fires_cancels(group):
    c = Collector()
    cancelled = []
    assert group.try_submit_all("a", [c.sub(f"a{i}", [5, 6, i], LONG, probe=lambda: bool(cancelled))
                                      for i in range(4)])
    assert group.try_submit_all("b", [c.sub("b0", [5, 6, 7])]) is None      # 4 in flight, the limit
    cancelled.append(True)
    finals = c.until_final([f"a{i}" for i in range(4)])
    assert {f.finish_reason for f in finals.values()} == {"cancelled"}
    assert all(len(c.tokens[f"a{i}"]) < 400 for i in range(4)) and group.in_flight == 0


def test_a_killed_engine_process_ends_every_request_with_an_error(group):
    c = Collector()
    group.try_submit_all("k", [c.sub("k0", [5, 6, 7], LONG), c.sub("k1", [5, 6, 8], LONG)])
    c.until_final([], timeout=1)
    os.kill(group.pid, signal.SIGKILL)
    finals = c.until_final(["k0", "k1"])
    assert all(f.finish_reason == "error" and "exit code -9" in f.error for f in finals.values())
    assert all(len(v) == 1 for v in c.finals.values())
    with pytest.raises(EngineUnavailable, match="exited unexpectedly"):
        group.try_submit_all("z", [c.sub("z0", [5, 6, 7])])
    assert group.in_flight == 0


def test_shutdown_ends_the_requests_in_flight_once_each():
    c = Collector()
    g = EngineProcessGroup.start(CONFIG, ParallelConfig(), max_in_flight=None)
    g.try_submit_all("s", [c.sub(f"s{i}", [5, 6, i], LONG) for i in range(3)])
    g.shutdown()
    finals = c.until_final(["s0", "s1", "s2"], timeout=5)
    assert {f.finish_reason for f in finals.values()} == {"cancelled"}
    assert all(len(v) == 1 for v in c.finals.values())
    assert g._process.returncode == 0


def test_a_start_that_fails_raises_with_the_engine_process_error():
    bad = EngineConfig.from_mapping({"model": "dummy:no-such-model", "device": "cpu", "num_pages": "8"})
    with pytest.raises(EngineUnavailable, match="(?s)could not build the engines:.*no-such-model"):
        EngineProcessGroup.start(bad, ParallelConfig(), max_in_flight=None)


def test_logprobs_and_generation_logits_cross_the_process_intact(group):
    import torch

    params = SamplingParams(max_tokens=3, min_tokens=3, temperature=0.0, logprobs=2, return_generation_logits=True)
    c = Collector()
    outs = []
    c.sink = lambda batch: [outs.append(o) or c.q.put(o) for o in batch]
    group.try_submit_all("l", [Submission("l0", [3, 4, 5], params, "", False, None, None, batch_sink=c.sink)])
    c.until_final(["l0"])
    engine = LLMEngine(CONFIG)
    engine.add_request("l0", [3, 4, 5], params)
    here = []
    while engine.has_work:
        here += engine.step()
    logits = [t for o in outs for t in o.generation_logits]
    assert len(logits) == 3 and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, [t for o in here for t in o.generation_logits]))
    assert [lp for o in outs for lp in o.logprobs] == [lp for o in here for lp in o.logprobs]
    assert [t for o in outs for t in o.top_logprobs] == [t for o in here for t in o.top_logprobs]
