#!/usr/bin/env bash
# kvshare_kernels on the GPU machine, from the repo root: the kernel tests (compiled Triton, GPU
# tests included), then the decode and prefill benchmarks. Logs and JSON go to $OUT.
#
#   SWEEP=decode,prefill bash perf/gpu/kernels_gpu.sh [all|tests|bench]
#
# SWEEP (optional) adds the tuning sweeps of docs/kernels.md before the tables.
# The tests run first so that a wrong kernel is never timed; a failing test stops the script.
set -o pipefail
MODE=${1:-all}
DSWEEP=; PSWEEP=
case ",${SWEEP:-}," in *,decode,*) DSWEEP=--sweep;; esac
case ",${SWEEP:-}," in *,prefill,*) PSWEEP=--sweep;; esac
OUT=${OUT:-/tmp/kvshare-kernels-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu,memory.used --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/gpu.txt"

if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  # -n 4: four processes compile the many small kernel variants in parallel (one GPU, shared)
  timeout 180 python3 -m pytest tests/kernels -q -n 4 -p no:cacheprovider -o addopts= 2>&1 | tee "$OUT/tests.log"
  rc=$?
  [ $rc -eq 0 ] || { echo "kernel tests failed (rc $rc): no benchmark"; exit $rc; }
fi

if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  timeout 270 python3 perf/kernels/bench_decode_attention.py --table $DSWEEP \
      --json "$OUT/decode.json" --md "$OUT/tables.md" 2>&1 | tee "$OUT/decode.log"
  timeout 130 python3 perf/kernels/bench_prefill_attention.py $PSWEEP \
      --json "$OUT/prefill.json" --md "$OUT/tables.md" 2>&1 | tee "$OUT/prefill.log"
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee -a "$OUT/gpu.txt"
  cat "$OUT/tables.md"
fi
