#!/usr/bin/env bash
# The engine on the GPU machine, from the repo root: forward parity with HF (fp32 exact, bf16/fp16
# reported), decode CUDA graphs vs eager (greedy tokens equal, GPU unit tests incl. the fused norm/rotary
# kernels, step times with the fusion on and off), then the
# offline benchmark (kvshare vs HF generate, Llama-2-7B shape, fp16, random weights). Logs go to $OUT.
# Each stage has its own time limit and a failing stage does not stop the next one (each prints its
# exit status as "[stage rc=N, S s]").
#
#   bash perf/gpu/engine_gpu.sh [parity|graphs|bench|all|shared]
MODE=${1:-all}
OUT_DEFAULT=/tmp/kvshare-engine-out
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"

if [ "$MODE" = all ] || [ "$MODE" = parity ]; then
  stage timeout 150 python3 perf/gpu/check_forward_parity.py 2>&1 | tee "$OUT/parity.log"
fi
if [ "$MODE" = all ] || [ "$MODE" = graphs ]; then
  {
    stage timeout 200 python3 perf/gpu/check_cuda_graphs.py
    stage timeout 90 python3 -m pytest -q -p no:cacheprovider tests/runtime \
        tests/engine/test_overlap_schedule.py::test_overlap_with_cuda_graphs_is_identical
    stage timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_norm.py \
        tests/kernels/test_fused_rotary.py tests/kernels/test_fused_forward.py tests/kernels/test_fused_silu.py
  } 2>&1 | tee "$OUT/graphs.log"
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  stage timeout 240 $OFFLINE_7B --dtype float16 --workloads seed-12x128,fixed-64,fixed-256 --max-requests 256 \
     --baselines generate --json "$OUT/bench_fixed.json" 2>&1 | quiet | tee "$OUT/bench_fixed.log"
  stage timeout 150 $OFFLINE_7B --dtype float16 --workloads seed-hot10 --max-requests 96 --baselines no-sharing,generate \
     --json "$OUT/bench_hot10.json" 2>&1 | quiet | tee "$OUT/bench_hot10.log"
fi
if [ "$MODE" = shared ]; then
  # SGLang's generated-shared-prefix shape (2048-token system prompt per group + 128-token question),
  # cut to its first 192 requests (~3 per group after the trace's shuffle) and 128 output tokens so it
  # fits a short lease: prefix sharing on vs off, same pool (KV_GB, default 40).
  stage timeout 200 $OFFLINE_7B --dtype float16 \
     --workloads shared-prefix --max-requests 192 --output-tokens 128 --baselines no-sharing --kv-gb ${KV_GB:-40} \
     --json "$OUT/bench_shared_prefix.json" 2>&1 | quiet | tee "$OUT/bench_shared_prefix.log"
fi
