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


def test_prefill_gather_loop_computes_row_offsets_once_and_in_int32(tmp_path):
    """The page-16 prefix loop of the prefill kernel (128-key tiles over 8 pages, each thread's rows
    gathered by cp.async): K's row offsets serve V, in int32 where the pools allow, so the loop is
    shorter than with int64 offsets per operand; a page-128 TMA tile's loop, with no addresses at all,
    is the floor."""
    out = tmp_path / "prefill.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, "-m", "perf.kernels.sass_loop", "--prefill", "--json", str(out)], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=300)
    by = {r["variant"]: r for r in json.loads(out.read_text())}
    before, shared, now, tma = (by[k]["instructions"] for k in ("int64 rows, V's own", "int64 rows, K's for V",
                                                               "int32 rows, K's for V", "page 128, TMA"))
    assert by["int32 rows, K's for V"]["opcodes"]["LDGSTS"] == 16     # 8 K and 8 V rows of 16 bytes a thread
    assert tma < now < shared < before
    assert now <= 0.92 * before
