#!/usr/bin/env bash
# The engine on the GPU machine, from the repo root: forward parity with HF (fp32 exact, bf16/fp16
# reported), then the offline benchmark (kvshare vs HF generate / generate_batch, Llama-2-7B shape,
# fp16, random weights). Logs go to $OUT.
#
#   bash perf/gpu/engine_gpu.sh [parity|bench|all]
set -o pipefail
MODE=${1:-all}
OUT=${OUT:-/tmp/kvshare-engine-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"

if [ "$MODE" = all ] || [ "$MODE" = parity ]; then
  timeout 240 python3 perf/gpu/check_forward_parity.py 2>&1 | tee "$OUT/parity.log"
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  B="timeout 400 python3 perf/offline_benchmark.py --model dummy:llama-2-7b --device cuda --dtype float16"
  $B --workloads seed-12x128,fixed-64,fixed-256 --max-requests 256 --baselines generate \
     --json "$OUT/bench_fixed.json" 2>&1 | grep -v "it/s]" | tee "$OUT/bench_fixed.log"
  $B --workloads seed-hot10 --max-requests 96 --baselines no-sharing,generate \
     --json "$OUT/bench_hot10.json" 2>&1 | grep -v "it/s]" | tee "$OUT/bench_hot10.log"
fi
