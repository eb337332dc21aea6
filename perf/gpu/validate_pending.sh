#!/usr/bin/env bash
# What was built on the CPU machine and not yet measured on the GPU, in two calls on the GPU machine
# (from the repo root; logs and JSON go to $OUT):
#   part a (~7 min): GPU unit tests (overlap scheduling with CUDA graphs, fused and cascade kernels,
#          cascade graphs); fixed-64 / fixed-256 with overlap scheduling off and on, each with a step
#          profile (seconds per prefill / mixed / decode step); the sampler (full sort vs
#          sample_grouped) and the engine at temperature 1.0.
#   part b (~4 min, carry .carry/fullstack): seed-12x128 beside seed-hot10 (36 requests each, fcfs;
#          hot10 also without sharing and with cache_aware), then the whole stack twice
#          (perf/gpu/fullstack_gpu.sh plain and with KVSHARE_STREAM_INTERVAL=4).
#
#   bash perf/gpu/validate_pending.sh a
#   bash perf/gpu/validate_pending.sh b
PART=${1:-a}
OUT_DEFAULT=/tmp/kvshare-validate-out
source "$(dirname "$0")/gpu_env.sh"

nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
if [ "$PART" = a ]; then
  stage timeout 170 python3 -m pytest -q -p no:cacheprovider tests/runtime tests/kernels/test_fused_silu.py \
      tests/kernels/test_cascade_decode.py tests/kernels/test_cascade_forward.py \
      tests/engine/test_overlap_schedule.py::test_overlap_with_cuda_graphs_is_identical 2>&1 | tail -15 | tee "$OUT/tests.log"
  BENCH_EXTRA=--step-profile OUT="$OUT" stage bash perf/gpu/bench_table.sh overlap 2>&1 | tee "$OUT/overlap.log" \
      | grep -E "^fixed|rc=|^   "
  stage timeout 60 python3 perf/gpu/bench_sampler.py --batches 12,64,256 --vocabs 32000,128256 \
      --json "$OUT/sampler.json" 2>&1 | tee "$OUT/sampler.log" | tail -20
  stage timeout 100 $OFFLINE_7B --workloads fixed-64:128,fixed-256:256 --baselines "" --temperature 1.0 --step-profile \
      --json "$OUT/engine_t1.json" 2>&1 | quiet | grep -E "^fixed|rc=|^   " | tee "$OUT/engine_t1.log"
fi
if [ "$PART" = b ]; then
  stage timeout 100 $OFFLINE_7B --workloads seed-12x128:36:,seed-hot10:36:no-sharing --step-profile \
      --json "$OUT/hot10_fcfs.json" 2>&1 | quiet | grep -E "^seed|rc=|^   " | tee "$OUT/hot10_fcfs.log"
  stage timeout 60 $OFFLINE_7B --workloads seed-hot10:36: --admission cache_aware \
      --json "$OUT/hot10_cache_aware.json" 2>&1 | quiet | grep -E "^seed|rc=" | tee "$OUT/hot10_cache_aware.log"
  OUT=$OUT/fullstack-plain stage bash perf/gpu/fullstack_gpu.sh 2>&1 | grep -E "rc=|server / offline|^\| " | tail -8
  KVSHARE_STREAM_INTERVAL=4 OUT=$OUT/fullstack-si4 stage bash perf/gpu/fullstack_gpu.sh 2>&1 \
      | grep -E "rc=|server / offline|^\| " | tail -8
fi
