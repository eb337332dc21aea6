#!/usr/bin/env bash
# The issue-4 benchmark table on the GPU machine, from the repo root: kvshare beside HF transformers
# `generate` and `generate_batch` (and kvshare without prefix sharing) on the same requests, one
# process per part. Llama-2-7B shape, fp16 (one bf16 row), random weights, EOS ignored.
# Two parts so that each fits one 10-minute call; both write JSON rows to $OUT, and
#   python perf/gpu/bench_table.py $OUT/table_*.json
# merges them into one Markdown table with the ratios and the bandwidth ceilings.
#
#   bash perf/gpu/bench_table.sh part1    # fixed-1, seed-12x128, seed-hot10, seed-long
#   bash perf/gpu/bench_table.sh part2    # fixed-64, fixed-256, bf16 fixed-64, shared-prefix
set -o pipefail
PART=${1:-part1}
OUT=${OUT:-/tmp/kvshare-table-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd "$(dirname "$0")/../.."
stage() { local t0=$SECONDS; "$@"; local rc=$?; echo "[stage rc=$rc, $((SECONDS - t0)) s]"; return $rc; }
B="python3 perf/offline_benchmark.py --model dummy:llama-2-7b --device cuda"
quiet() { grep --line-buffered -v "it/s]"; }

if [ "$PART" = part1 ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
  stage timeout 100 $B --workloads fixed-1 --max-requests 4 --baselines generate \
     --json "$OUT/table_fixed1.json" 2>&1 | quiet | tee "$OUT/table_fixed1.log"
  stage timeout 200 $B --workloads seed-12x128 --max-requests 48 --baselines generate,generate_batch \
     --json "$OUT/table_seed12.json" 2>&1 | quiet | tee "$OUT/table_seed12.log"
  stage timeout 120 $B --workloads seed-hot10 --max-requests 48 --baselines no-sharing,generate \
     --json "$OUT/table_hot10.json" 2>&1 | quiet | tee "$OUT/table_hot10.log"
  stage timeout 150 $B --workloads seed-long --max-requests 36 --baselines no-sharing,generate \
     --json "$OUT/table_long.json" 2>&1 | quiet | tee "$OUT/table_long.log"
fi
if [ "$PART" = part2 ]; then
  stage timeout 150 $B --workloads fixed-64 --max-requests 128 --baselines generate,generate_batch \
     --json "$OUT/table_fixed64.json" 2>&1 | quiet | tee "$OUT/table_fixed64.log"
  stage timeout 150 $B --workloads fixed-256 --max-requests 256 --baselines generate,generate_batch \
     --json "$OUT/table_fixed256.json" 2>&1 | quiet | tee "$OUT/table_fixed256.log"
  stage timeout 60 $B --dtype bfloat16 --workloads fixed-64 --max-requests 128 --baselines "" \
     --json "$OUT/table_fixed64_bf16.json" 2>&1 | quiet | tee "$OUT/table_fixed64_bf16.log"
  # SGLang's generated-shared-prefix, sent all at once (its --request-rate inf): the engine's admission
  # policy orders the queue; HF is left out (2,176-token prompts x 256 new tokens: minutes per batch).
  stage timeout 200 $B --workloads shared-prefix --max-requests ${SP_REQUESTS:-512} --open-loop --max-running 256 \
     --kv-gb ${KV_GB:-100} --baselines no-sharing \
     --json "$OUT/table_shared.json" 2>&1 | quiet | tee "$OUT/table_shared.log"
fi
