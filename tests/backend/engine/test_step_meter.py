"""The engine loop's step log (engine/step_meter.py): periods summed by kind between reports, and the
loop's line in the log while it has work."""
from __future__ import annotations

import logging
import queue

from kvshare.engine.engine_loop import EngineLoop, Submission
from kvshare.engine.outputs import StepShape
from kvshare.engine.step_meter import StepMeter, step_kind
from kvshare.sampling_params import SamplingParams

from test_engine_loop_delivery import FakeEngine, collect_until_final


def test_kinds_follow_the_shape_and_the_runner_path():
    assert step_kind(StepShape(64, 0, "graph")) == ("decode", True)
    assert step_kind(StepShape(64, 0, "cascade-graph")) == ("decode", True)
    assert step_kind(StepShape(8, 0, "eager")) == ("decode", False)
    assert step_kind(StepShape(60, 190, "mixed-graph")) == ("mixed", True)
    assert step_kind(StepShape(60, 2000, "eager")) == ("mixed", False)
    assert step_kind(StepShape(0, 4096, "eager")) == ("prefill", False)


def test_a_report_sums_each_kind_once_the_interval_passed_and_starts_over():
    meter = StepMeter(2.0, now=100.0)
    for _ in range(3):
        meter.add(StepShape(64, 0, "graph"), 0.006)
    meter.add(StepShape(62, 190, "mixed-graph"), 0.009)
    assert meter.report(101.0) is None                      # before the interval
    line = meter.report(102.0)
    assert line.startswith("4 steps in 2.0 s (1% busy): ")
    assert "decode graph 3 x 6.00 ms (64.0 rows)" in line
    assert "mixed graph 1 x 9.00 ms (62.0 rows, 190 prefill tok)" in line
    assert line.index("decode graph") < line.index("mixed graph")   # the kind that took longest first
    assert line.endswith("; 127 decode tok/s")              # (3 x 64 + 62) rows / 2 s
    assert meter.report(104.5) is None                      # nothing ran since: no line
    meter.add(StepShape(1, 0, "eager"), 0.004)
    assert meter.report(105.0) is None                      # the interval restarted at 104.5


def test_interval_zero_never_reports():
    meter = StepMeter(0.0, now=0.0)
    meter.add(StepShape(1, 0, "graph"), 1.0)
    assert meter.report(1e9) is None


class ShapedEngine(FakeEngine):
    last_step = StepShape(1, 0, "eager")


def test_the_loop_logs_its_steps_while_it_has_work(caplog):
    engine = ShapedEngine(step_s=0.01)
    out: queue.SimpleQueue = queue.SimpleQueue()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    caplog.set_level(logging.INFO, logger="kvshare.engine")
    loop = EngineLoop(engine, step_log_s=0.1, label="engine 1: ")
    try:
        loop.submit(Submission("a", [1, 2, 3], params, "", False, None, None, batch_sink=out.put))
        collect_until_final(out, 1)
    finally:
        loop.shutdown()
    lines = [r.getMessage() for r in caplog.records if "steps:" in r.getMessage()]
    assert lines, "no step line in 40 steps of 10 ms with a 0.1 s interval"
    assert all(m.startswith("engine 1: steps: ") and "decode " in m and "(1.0 rows)" in m for m in lines)
