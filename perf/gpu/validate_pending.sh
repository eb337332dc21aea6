#!/usr/bin/env bash
# What session 2 built on the CPU and could not measure on the GPU (its device time ran out), in one
# call of ~6 minutes on the GPU machine, from the repo root; logs and JSON go to $OUT:
#   1. correctness: GPU unit tests incl. overlap scheduling with CUDA graphs, fused kernels, cascade kernels;
#   2. overlap scheduling A/B on fixed-64 / fixed-256 (perf/gpu/bench_table.sh overlap);
#   3. the sampler: old full-sort vs sample_grouped, and the engine at temperature 1.0 (top-k 0 / 50);
#   4. seed-hot10 with fcfs vs cache_aware admission (the warm-up now covers cached-prefix extends).
# The whole stack is separate (it needs the carried bundle): bash perf/gpu/fullstack_gpu.sh, once
# plain and once with KVSHARE_STREAM_INTERVAL=4.
#
#   bash perf/gpu/validate_pending.sh
OUT_DEFAULT=/tmp/kvshare-validate-out
source "$(dirname "$0")/gpu_env.sh"

nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
stage timeout 150 python3 -m pytest -q -p no:cacheprovider tests/runtime tests/kernels/test_fused_silu.py \
    tests/kernels/test_cascade_decode.py tests/kernels/test_cascade_forward.py \
    tests/engine/test_overlap_schedule.py::test_overlap_with_cuda_graphs_is_identical 2>&1 | tail -15 | tee "$OUT/tests.log"
OUT="$OUT" stage bash perf/gpu/bench_table.sh overlap 2>&1 | tee "$OUT/overlap.log" | grep -E "^fixed|rc="
stage timeout 60 python3 perf/gpu/bench_sampler.py --batches 12,64,256 --vocabs 32000,128256 \
    --json "$OUT/sampler.json" 2>&1 | tee "$OUT/sampler.log" | tail -20
stage timeout 100 $OFFLINE_7B --workloads fixed-64:128,fixed-256:256 --baselines "" --temperature 1.0 \
    --json "$OUT/engine_t1.json" 2>&1 | quiet | grep -E "^fixed|rc=" | tee "$OUT/engine_t1.log"
stage timeout 100 $OFFLINE_7B --workloads fixed-64:128,fixed-256:256 --baselines "" --temperature 1.0 --top-k 50 \
    --json "$OUT/engine_t1_k50.json" 2>&1 | quiet | grep -E "^fixed|rc=" | tee "$OUT/engine_t1_k50.log"
for A in fcfs cache_aware; do
  stage timeout 60 $OFFLINE_7B --workloads seed-hot10:36:no-sharing --admission $A \
      --json "$OUT/hot10_$A.json" 2>&1 | quiet | grep -E "^seed|rc=" | tee "$OUT/hot10_$A.log"
done
