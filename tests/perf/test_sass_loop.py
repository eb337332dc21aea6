"""perf/kernels/sass_loop.py: the decode kernel compiled for Hopper on this CPU machine (Triton's
ptxas), its hot loop counted. Over fp8 pages with bf16 queries the loop must convert each pair of
e4m3 values with one native instruction and no scalar F2F (kv_tiles.dot_query: the dots run in fp16)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fp8_decode_converts_natively_and_streams_like_bf16(tmp_path):
    out = tmp_path / "loop.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, "-m", "perf.kernels.sass_loop", "--json", str(out)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=300)
    by = {r["kv"]: r for r in json.loads(out.read_text())}
    assert set(by) == {"bf16", "fp8", "int8"}
    fp8, bf16 = by["fp8"], by["bf16"]
    assert fp8["block_n"] == 128 and bf16["block_n"] == 64          # the launcher's tiles per layout
    assert fp8["opcodes"].get("F2F", 0) == 0
    pairs_per_lane = fp8["elements"] // 2 // 32
    assert fp8["opcodes"]["F2FP"] >= pairs_per_lane                  # e4m3x2 -> f16x2, one per pair
    assert bf16["opcodes"].get("F2F", 0) == 0 and bf16["opcodes"]["HMMA"] > 0
