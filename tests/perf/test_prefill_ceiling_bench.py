"""perf/kernels/bench_prefill_ceiling.py on the CPU (--dry-run: tiny shapes, the Triton interpreter):
every launch it times, the chunk's keys from the step's K/V included, computes the engine's answer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_launch_of_the_ceiling_bench_gives_the_engines_answer(tmp_path):
    out = tmp_path / "ceiling.json"
    md = tmp_path / "ceiling.md"
    subprocess.run([sys.executable, "perf/kernels/bench_prefill_ceiling.py", "--dry-run", "--json", str(out),
                    "--md", str(md)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    records = json.loads(out.read_text())["records"]
    assert {r["case"] for r in records} == {"prompt 1x32", "chunk 1x(16+16)"}
    for r in records:
        # the step's K/V with the prefix's ids read ahead and per tile, and every pool launch
        assert {"16x32 w4 s2", "16x32 w4 s2 per tile"} <= set(r["new_kv"])
        launches = [*r["paged16"].values(), *r["new_kv"].values(), *r["dense"].values(),
                    *(v for page in r["paged"].values() for v in page.values())]
        assert any("step-kv" in k for page in r["paged"].values() for k in page)
        for v in launches:
            assert v["s"] and v["s"] > 0
            assert v["diff"] < 1e-2        # against the engine's page-16 launch, on the same tokens
    assert "p16 step K/V / FA3" in md.read_text()
