"""perf/report/plot_h200.py reads the offline benchmark's rows from its printed table and draws a PNG."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.report import plot_h200  # noqa: E402

PRINTED = """\
workload        system               reqs  out tok       s    tok/s  TTFT p50   p95 ms  KV GB   hit vs hf-gen
--------------------------------------------------------------------------------------------------------
fixed-64        kvshare               128    16384     1.9   8425.8       179      189   8.59  0.25      8.34
fixed-64        hf-generate           128    16384    16.2   1010.0     11824    11824      -     -      1.00
[stage rc=0, 130 s]
seed-hot10      kvshare (median of 3)               240    30720    12.6   2431.6        27       32   1.65  0.63
fixed-64        kvshare               128    16384     2.0   9999.0       179      189   8.59  0.25      8.34
"""


def test_printed_rows_first_occurrence_wins_and_labels_lose_the_median_note():
    rows = plot_h200.rows_from_printed(PRINTED)
    by = {(r["workload"], r["system"]): r["tok_per_s"] for r in rows}
    assert by == {("fixed-64", "kvshare"): 8425.8, ("fixed-64", "hf-generate"): 1010.0,
                  ("seed-hot10", "kvshare"): 2431.6}


def test_draws_the_three_panels(tmp_path, monkeypatch):
    table = tmp_path / "table.txt"
    table.write_text(PRINTED)
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps([{"system": "kvshare (cache_aware)", "tok_per_s": 5322.1},
                                  {"system": "kvshare-no-sharing (cache_aware)", "tok_per_s": 1795.9}]))
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"rows": [{"path": "offline engine (perf/engine/offline_benchmark.py)", "server_tok_per_s": 8084},
                                            {"path": "Triton gRPC streaming, perf_analyzer, c=64", "server_tok_per_s": 6794}]}))
    out = tmp_path / "plot.png"
    monkeypatch.setattr(sys, "argv", ["plot_h200.py", "--table", str(table), "--shared", str(shared),
                                      "--fullstack", str(summary), "-o", str(out)])
    plot_h200.main()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
