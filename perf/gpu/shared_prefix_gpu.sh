#!/usr/bin/env bash
# Cascade decode graphs on the GPU machine, one call (~7 min), from the repo root; logs/JSON to $OUT:
#   1. GPU tests: decode graphs incl. cascade graphs vs plain graphs (same greedy tokens), the
#      graph-resident plan against the plain decode, fused kernels;
#   2. shared-prefix, the whole trace (64 groups x 16 requests, 2048-token system prompt + 128-token
#      question, 256 out), sent at once: kvshare (sharing, cascade graphs, cache_aware admission) vs
#      the same engine without sharing, 100 GB pool, 256 running at most, step profiles;
#   3. what cascade attention adds: the trace's first 256 requests with sharing, cascade on vs off.
#
#   4. (part profile, ~2 min) where a cascade-graph decode step and a mixed step spend their time
#      (perf/gpu/profile_shared_prefix_gpu.py: 16 groups x 16 rows, then 32 x 8).
#
#   bash perf/gpu/shared_prefix_gpu.sh [tests|full|attribution|profile|all]
PART=${1:-all}
OUT_DEFAULT=/tmp/kvshare-shared-out
source "$(dirname "$0")/gpu_env.sh"
# admission delay 8: arrivals share mixed steps (docs/results/h200-s4.md: 5,825 vs 5,315 tok/s with sharing)
SP="--open-loop --max-running 256 --admission cache_aware --admission-delay ${SP_DELAY:-8} --kv-gb ${KV_GB:-100} --step-profile ${SP_EXTRA:-}"

nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  stage timeout 170 python3 -m pytest -q -p no:cacheprovider tests/runtime tests/kernels/test_cascade_forward.py \
      tests/kernels/test_fused_silu.py 2>&1 | tail -8 | tee "$OUT/tests.log"
fi
if [ "$PART" = full ] || [ "$PART" = all ]; then
  stage timeout 420 $OFFLINE_7B --workloads shared-prefix:1024:no-sharing $SP \
      --json "$OUT/shared_full.json" 2>&1 | quiet | grep -E "^shared|rc=|^   |^==" | tee "$OUT/shared_full.log"
fi
if [ "$PART" = attribution ] || [ "$PART" = all ]; then
  stage timeout 150 $OFFLINE_7B --workloads shared-prefix:256: $SP --no-cascade \
      --json "$OUT/shared_256_nocascade.json" 2>&1 | quiet | grep -E "^shared|rc=|^   " | tee "$OUT/shared_256_nocascade.log"
  stage timeout 100 $OFFLINE_7B --workloads shared-prefix:256: $SP \
      --json "$OUT/shared_256.json" 2>&1 | quiet | grep -E "^shared|rc=|^   " | tee "$OUT/shared_256.log"
fi
if [ "$PART" = profile ]; then
  stage timeout 150 python3 perf/gpu/profile_shared_prefix_gpu.py --out "$OUT/profile_16x16" 2>&1 | quiet \
      | tee "$OUT/profile_16x16.log" | tail -45
  stage timeout 150 python3 perf/gpu/profile_shared_prefix_gpu.py --groups 32 --members 8 --out "$OUT/profile_32x8" 2>&1 \
      | quiet | tee "$OUT/profile_32x8.log" | tail -45
fi
