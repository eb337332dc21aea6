"""perf/peer/serving_ceiling.py: the serving roofline per closed-loop point."""
from __future__ import annotations

import json

import pytest

from perf.core.workload_traces import make_trace
from perf.peer import serving_ceiling as sc

H200 = sc.ROOFLINES["H200"]


def test_one_stream_reads_the_weights_per_token():
    """One request of 1 prompt token and 2 outputs: each output costs the weights plus its context's K/V."""
    shape = sc.ModelShape()
    got = sc.closed_loop_ceiling([1], [2], 1, H200, shape)
    prefill = shape.flops_per_token / H200.flops
    decode = 2 * (shape.weight_bytes + 1.5 * shape.kv_bytes_per_token) / H200.bandwidth   # contexts 1, 2: mean 1.5
    assert got == pytest.approx(2 / (prefill + decode), rel=1e-12)


def test_more_in_flight_raises_the_bound_until_compute_holds_it():
    reqs = make_trace("mixed-1k").requests[:200]
    prompts, outputs = [len(r.prompt_ids) for r in reqs], [r.max_new_tokens for r in reqs]
    bounds = [sc.closed_loop_ceiling(prompts, outputs, c, H200) for c in (1, 16, 64, 256)]
    assert bounds == sorted(bounds) and bounds[-1] < H200.flops / sc.ModelShape().flops_per_token


def test_report_table(tmp_path):
    point = dict(point="mixed-c16", loop="closed", trace="mixed-1k", requests=50, concurrency=16,
                 kvshare=dict(sustained_tok_per_s=2000.0), vllm=dict(sustained_tok_per_s=1900.0))
    other = dict(point="mixed-r8", loop="open", trace="mixed-1k", requests=50, concurrency=None)
    report = dict(info=["GPU: NVIDIA H200 (gpu.txt)"], points=[point, other])
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(report))
    md = tmp_path / "ceiling.md"
    sc.main([str(path), "--md", str(md)])
    rows = sc.rows(report, sc.gpu_of(report, None))
    assert [r["point"] for r in rows] == ["mixed-c16"]            # open loop has no closed-loop bound
    r = rows[0]
    assert r["vllm_share"] == pytest.approx(1900.0 / r["ceiling"]) and r["goal_share"] == pytest.approx(1.2 * r["vllm_share"])
    assert "| mixed-c16 | 16 |" in md.read_text() and "H200" in md.read_text()
    with pytest.raises(SystemExit, match="no known GPU"):
        sc.gpu_of(dict(info=["GPU: something else"]), None)
