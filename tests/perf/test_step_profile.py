"""perf/engine/step_profile.py (seconds per step kind) and perf/engine/offline_benchmark.py's --repeat median. No model."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.engine import offline_benchmark as ob  # noqa: E402
from perf.engine.step_profile import StepProfile, format_summary, step_kind  # noqa: E402

from kvshare.engine.outputs import StepShape  # noqa: E402


@pytest.mark.parametrize("shape, kind", [
    (StepShape(4, 100, "eager"), "mixed"),
    (StepShape(0, 100, "eager"), "prefill"),
    (StepShape(4, 100, "mixed-graph"), "mixed graph"),
    (StepShape(0, 100, "mixed-graph"), "prefill graph"),
    (StepShape(64, 0, "graph"), "decode graph"),
    (StepShape(3, 0, "cascade-graph"), "decode cascade-graph"),
    (StepShape(0, 0, "none"), "idle"),
])
def test_step_kind(shape, kind):
    assert step_kind(shape) == kind


def test_summary_sums_per_kind_slowest_first_and_the_remainder():
    p = StepProfile()
    p.add(StepShape(0, 256, "eager"), 0.5)
    p.add(StepShape(8, 0, "graph"), 0.010)
    p.add(StepShape(6, 0, "graph"), 0.020)
    p.add(StepShape(2, 30, "eager"), 0.1)
    s = p.summary(1.0)
    assert list(s) == ["prefill", "mixed", "decode graph", "outside steps"]
    assert s["decode graph"] == {"steps": 2, "seconds": 0.03, "ms_per_step": 15.0, "decode_rows_per_step": 7.0,
                                 "prefill_tokens": 0}
    assert s["prefill"]["prefill_tokens"] == 256 and s["prefill"]["ms_per_step"] == 500.0
    assert s["mixed"]["decode_rows_per_step"] == 2.0 and s["mixed"]["prefill_tokens"] == 30
    assert s["outside steps"] == {"seconds": pytest.approx(0.37)}


def test_empty_profile_is_all_outside_steps():
    assert StepProfile().summary(2.5) == {"outside steps": {"seconds": 2.5}}


def test_format_summary_lines_and_shares():
    p = StepProfile()
    p.add(StepShape(0, 64, "eager"), 0.25)
    p.add(StepShape(4, 0, "graph"), 0.25)
    lines = format_summary(p.summary(1.0), 1.0).splitlines()
    assert len(lines) == 3
    prefill, decode, outside = lines
    assert prefill.split()[0] == "prefill" and "25.0%" in prefill and "64 prefill tok" in prefill
    assert decode.lstrip().startswith("decode graph") and "1 steps x 250.00 ms, 4 decode rows" in decode
    assert "prefill tok" not in decode
    assert outside.lstrip().startswith("outside steps") and "50.0%" in outside and "steps x" not in outside
    assert "0.0%" in format_summary(StepProfile().summary(0.0), 0.0)   # no division by a zero total


shapes = st.builds(StepShape, st.integers(0, 512), st.integers(0, 4096),
                   st.sampled_from(["graph", "cascade-graph", "cascade", "eager", "none"]))


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(shapes, st.floats(0.0, 0.5, allow_nan=False)), max_size=60),
       outside=st.floats(0.0, 10.0, allow_nan=False))
def test_kinds_plus_outside_steps_add_up_to_the_total(steps, outside):
    p = StepProfile()
    for shape, seconds in steps:
        p.add(shape, seconds)
    total = sum(s for _, s in steps) + outside
    summary = p.summary(total)
    assert set(summary) == {step_kind(sh) for sh, _ in steps} | {"outside steps"}
    assert sum(v.get("steps", 0) for v in summary.values()) == len(steps)
    # every figure is rounded to 0.1 ms: allow half a unit per entry
    assert sum(v["seconds"] for v in summary.values()) == pytest.approx(total, abs=5e-5 * len(summary) + 1e-9)


# -- --repeat: the median run ------------------------------------------------------------------------
def row(tok_per_s: float, ttft: float = 1.0) -> ob.Row:
    return ob.Row("fixed-64", "kvshare", 128, 16384, 16384 / tok_per_s, tok_per_s, ttft, ttft, 10, 0.0)


def test_median_run_keeps_the_middle_run_whole_and_every_figure_in_order():
    runs = [row(8100.0, ttft=1), row(8342.0, ttft=2), row(7900.0, ttft=3)]
    m = ob.median_run(runs)
    assert m == ob.replace(runs[0], runs_tok_per_s=[8100.0, 8342.0, 7900.0])
    assert ob.system_label(m) == "kvshare (median of 3)"


def test_median_run_of_an_even_count_is_the_lower_middle_run():
    m = ob.median_run([row(4.0), row(1.0), row(3.0), row(2.0)])
    assert m.tok_per_s == 2.0 and m.runs_tok_per_s == [4.0, 1.0, 3.0, 2.0]


def test_one_run_is_returned_as_is():
    r = row(5.0)
    assert ob.median_run([r]) == r and r.runs_tok_per_s is None and ob.system_label(r) == "kvshare"
    with pytest.raises(ValueError):
        ob.median_run([])


@given(st.lists(st.floats(1.0, 1e5, allow_nan=False), min_size=1, max_size=9))
def test_median_run_has_as_many_runs_above_as_below(figures):
    m = ob.median_run([row(f) for f in figures])
    below = sum(f < m.tok_per_s for f in figures)
    above = sum(f > m.tok_per_s for f in figures)
    assert below <= (len(figures) - 1) // 2 and above <= len(figures) // 2
    assert m.tok_per_s in figures


def test_repeat_runs_n_times_and_overlap_labels_only_explicit_settings():
    figures = iter([3.0, 1.0, 2.0])
    assert ob.run_repeated(lambda: row(next(figures)), 3).tok_per_s == 2.0
    assert [ob.overlap_label(v) for v in (True, False, None)] == ["overlap", "no overlap", ""]


def test_row_hit_rate_leaves_the_warm_up_out():
    from kvshare.core.types import PoolStats

    def stats(queries: int, hits: int) -> PoolStats:
        return PoolStats(total=10, free=10, active=0, cached=0, evictions_total=0, prefix_queries_tokens_total=queries,
                         prefix_hits_tokens_total=hits, preemptions_total=0)

    warm = stats(2048, 1016)               # the warm-up's second pass hits on purpose
    assert ob.hit_rate_since(warm, stats(2048 + 4096, 1016)) == 0.0          # distinct prompts: no hit
    assert ob.hit_rate_since(warm, stats(2048 + 4096, 1016 + 1024)) == 0.25
    assert ob.hit_rate_since(warm, warm) == 0.0


def test_a_pool_sized_for_an_h200_shrinks_to_what_vllms_default_leaves_on_a_smaller_gpu():
    from perf.engine.offline_benchmark import fit_kv_gb
    assert fit_kv_gb(100, total_gb=140.0, weights_gb=12.6) == 100          # an H200 holds it
    assert fit_kv_gb(100, total_gb=79.2, weights_gb=12.6) == 54             # an H100: 0.9 x 79.2 - 12.6 - 4
    assert fit_kv_gb(40, total_gb=79.2, weights_gb=12.6) == 40
