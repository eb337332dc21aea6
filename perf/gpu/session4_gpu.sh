#!/usr/bin/env bash
# Session 4 on the GPU machine (from the repo root; logs and JSON to $OUT):
#   part upload (~4 min): eager prefill/mixed steps upload their inputs without blocking the host
#     (forward_batch.py): GPU tests, the fixed-256 prefill phase profile (perf/gpu/profile_prefill_gpu.py),
#     fixed-256 x3 and fixed-64 with step profiles, the prefill kernel's tile sweep at fixed-256's
#     chunks (32 x 128 new tokens).
#   part delay (~7 min): shared-prefix, the whole trace, with admission delay D (EngineConfig.admission_delay_steps)
#     and without; no sharing with the delay. DELAYS="0 8" by default.
#
#   part final (~6 min): the issue-4 table (perf/gpu/bench_table.sh part1) and seed-hot10 beside seed-12x128
#     on the whole traces (--repeat 3, medians), with the final code.
#
#   part fused (~3 min): rotary fused into the KV write (kvshare_kernels.fused_rotary.rotary_write_kv): GPU
#     kernel/runtime/engine tests, fixed-256 x3 and fixed-64 x3 with step profiles.
#
#   part next (~6 min, not run yet: for session 5): what session 4 changed without measuring it:
#     fixed-64 / fixed-256 --repeat 3 (does run 1 now match runs 2-3, with the page table padded to 16
#     columns?), seed-12x128 and seed-hot10 whole traces with admission delay 0 and 8 (may the delay be a
#     default?), the prefill tile sweep at fixed-256's chunks.
#
#   part tier (~5 min, not run yet): the host tier (EngineConfig.host_cache_memory_gb) on shared-prefix with a
#     pool too small for its 64 system prompts (20 GB): without the tier, then with 64 GB of pinned host pages
#     (shared pages only, the default), then spilling every evicted page (--host-min-hits 0).
#
#   bash perf/gpu/session4_gpu.sh upload|delay|final|fused|next|tier
PART=${1:-upload}
OUT_DEFAULT=/tmp/kvshare-s4-out
source "$(dirname "$0")/gpu_env.sh"
SP="--open-loop --max-running 256 --admission cache_aware --kv-gb 100 --step-profile"

nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
if [ "$PART" = upload ]; then
  stage timeout 150 python3 -m pytest -q -p no:cacheprovider tests/runtime tests/kernels/test_cascade_forward.py \
      tests/kernels/test_fused_forward.py tests/engine/test_overlap_schedule.py 2>&1 | tail -6 | tee "$OUT/tests.log"
  stage timeout 120 python3 perf/gpu/profile_prefill_gpu.py --out "$OUT/prefill" 2>&1 | quiet > "$OUT/prefill.log"
  head -14 "$OUT/prefill.log"
  stage timeout 150 $OFFLINE_7B --workloads fixed-256:256:,fixed-64:128: --repeat 3 --step-profile \
      --json "$OUT/fixed.json" 2>&1 | quiet | grep -E "^fixed|rc=|^   " | tee "$OUT/fixed.log"
  (cd perf/kernels && PYTHONPATH=../../src stage timeout 90 python3 bench_prefill_attention.py --sweep --sweep-shape 32,0,128 --sweep-only \
      --mha-only 2>&1 | grep "^|" | tee "$OUT/prefill_sweep.log")
fi
if [ "$PART" = delay ]; then
  for d in ${DELAYS:-0 8}; do
    stage timeout 150 $OFFLINE_7B --workloads shared-prefix:1024: $SP --admission-delay "$d" \
        --json "$OUT/shared_d$d.json" 2>&1 | quiet | grep -E "^shared|rc=|^   " | tee "$OUT/shared_d$d.log"
  done
  stage timeout 300 $OFFLINE_7B --workloads shared-prefix:1024:no-sharing $SP --admission-delay "${NOSHARE_DELAY:-8}" \
      --json "$OUT/shared_noshare.json" 2>&1 | quiet | grep -E "^shared|rc=|^   " | tee "$OUT/shared_noshare.log"
fi
if [ "$PART" = final ]; then
  OUT="$OUT" stage bash perf/gpu/bench_table.sh part1 2>&1 | grep -E "^fixed|^seed|rc=" | tail -20
  stage timeout 200 $OFFLINE_7B --workloads seed-12x128,seed-hot10 --baselines "" --repeat 3 \
      --json "$OUT/hot10_full.json" 2>&1 | quiet | grep -E "^seed|rc=|per run" | tee "$OUT/hot10_full.log"
fi
if [ "$PART" = fused ]; then
  stage timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/runtime \
      tests/engine/test_overlap_schedule.py::test_overlap_with_cuda_graphs_is_identical 2>&1 | tail -4 | tee "$OUT/tests.log"
  stage timeout 150 $OFFLINE_7B --workloads fixed-256:256:,fixed-64:128: --repeat 3 --step-profile \
      --json "$OUT/fixed.json" 2>&1 | quiet | grep -E "^fixed|rc=|per run|decode graph|mixed" | tee "$OUT/fixed.log"
fi
if [ "$PART" = next ]; then
  stage timeout 150 $OFFLINE_7B --workloads fixed-256:256:,fixed-64:128: --repeat 3 --step-profile \
      --json "$OUT/fixed.json" 2>&1 | quiet | grep -E "^fixed|rc=|per run|mixed" | tee "$OUT/fixed.log"
  for d in 0 8; do
    stage timeout 150 $OFFLINE_7B --workloads seed-12x128,seed-hot10 --baselines "" --repeat 3 --admission-delay "$d" \
        --json "$OUT/seeds_d$d.json" 2>&1 | quiet | grep -E "^seed|rc=|per run" | tee "$OUT/seeds_d$d.log"
  done
  (cd perf/kernels && PYTHONPATH=../../src stage timeout 90 python3 bench_prefill_attention.py --sweep --sweep-shape 32,0,128 \
      --sweep-only --mha-only 2>&1 | grep "^|" | tee "$OUT/prefill_sweep.log")
fi
if [ "$PART" = tier ]; then
  for run in "0 1" "64 1" "64 0"; do
    set -- $run
    stage timeout 280 $OFFLINE_7B --workloads shared-prefix:1024: $SP --admission-delay 8 --kv-gb 20 --host-cache-gb "$1" \
        --host-min-hits "$2" --json "$OUT/shared_kv20_host$1_hits$2.json" 2>&1 | quiet | grep -E "^shared|rc=|^   " \
        | tee "$OUT/shared_kv20_host$1_hits$2.log"
  done
fi
