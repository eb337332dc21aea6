#!/usr/bin/env bash
# The issue-4 benchmark table on the GPU machine, from the repo root: kvshare beside HF transformers
# `generate` and `generate_batch` (and kvshare without prefix sharing) on the same requests, one
# process per part. Llama-2-7B shape, fp16 (one bf16 row), random weights, EOS ignored.
# Parts sized for a 10-minute call; they write JSON rows to $OUT, and
#   python perf/gpu/bench_table.py $OUT/table_*.json
# merges them into one Markdown table with the ratios and the bandwidth ceilings.
#
#   bash perf/gpu/bench_table.sh part1    # fixed-1, seed-12x128, seed-hot10, seed-long, fixed-64, fixed-256 (~5 min)
#   bash perf/gpu/bench_table.sh part2    # bf16 fixed-64, shared-prefix with sharing on/off (~3 min)
#   bash perf/gpu/bench_table.sh overlap  # fixed-64 and fixed-256 with overlap scheduling off / on (~2 min)
#   bash perf/gpu/bench_table.sh all
PART=${1:-part1}
OUT_DEFAULT=/tmp/kvshare-table-out
source "$(dirname "$0")/gpu_env.sh"

if [ "$PART" = part1 ] || [ "$PART" = all ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
  # One process (one model load) for every closed-loop workload; request counts cut so HF fits.
  stage timeout 300 $OFFLINE_7B --workloads "fixed-1:2:generate,seed-12x128:48:generate,seed-hot10:36:no-sharing,\
seed-long:24:no-sharing+generate,fixed-64:128:generate+generate_batch,fixed-256:256:generate" \
     --json "$OUT/table_main.json" 2>&1 | quiet | tee "$OUT/table_main.log"
fi
if [ "$PART" = part2 ] || [ "$PART" = all ]; then
  stage timeout 80 $OFFLINE_7B --dtype bfloat16 --workloads fixed-64:128 --baselines "" \
     --json "$OUT/table_fixed64_bf16.json" 2>&1 | quiet | tee "$OUT/table_fixed64_bf16.log"
  # SGLang's generated-shared-prefix, sent all at once (its --request-rate inf): the engine's admission
  # policy orders the queue; HF is left out (2,176-token prompts x 256 new tokens: minutes per batch).
  stage timeout 150 $OFFLINE_7B --workloads shared-prefix:${SP_REQUESTS:-256}:no-sharing --open-loop --max-running 256 --admission cache_aware \
     --kv-gb ${KV_GB:-100} --json "$OUT/table_shared.json" 2>&1 | quiet | tee "$OUT/table_shared.log"
fi
if [ "$PART" = overlap ]; then
  # --no-overlap: overlap scheduling is the engine's default on CUDA; the A/B names both sides.
  stage timeout 120 $OFFLINE_7B --workloads fixed-64:128,fixed-256:256 --baselines "" --no-overlap \
     --json "$OUT/table_sync.json" 2>&1 | quiet | tee "$OUT/table_sync.log"
  stage timeout 120 $OFFLINE_7B --workloads fixed-64:128,fixed-256:256 --baselines "" --overlap \
     --json "$OUT/table_overlap.json" 2>&1 | quiet | tee "$OUT/table_overlap.log"
fi
