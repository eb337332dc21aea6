#!/usr/bin/env bash
# How often does the server stall at shutdown after a streaming load? (docs/operate/troubleshoot.md,
# "Shutdown after a streaming load: the stub is never finalized")
#
#   bash perf/server/shutdown_check.sh [TRIALS] [REQUESTS] [CONCURRENCY] [OUTPUT_TOKENS]
#
# Each trial starts the real Triton server on the CPU with a dummy tiny model, streams REQUESTS
# requests of fixed-64 prompts over gRPC (perf/load/serving_load.py), stops the server with SIGINT
# and reads its log: "stall" when Triton waited out --exit-timeout-secs ("Exit timeout expired"),
# "clean" when finalize() ran ("kvshare engine stopped"). Defaults (8 trials, 16 requests, 2 at a
# time, 256 tokens: ~5 s of streaming) stalled in 4 of 5 trials, then 1 of 3, on the 2-core machine.
# Logs of the last trial stay in $SHUTDOWN_CHECK_DIR (default: a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/../.."
TRIALS=${1:-8}; N=${2:-16}; C=${3:-2}; T=${4:-256}
PY=${PYTHON:-.venv/bin/python}
DIR=${SHUTDOWN_CHECK_DIR:-$(mktemp -d)}
export KVSHARE_DEVICE=cpu KVSHARE_MODEL=dummy:tiny-llama KVSHARE_KV_CACHE_MEMORY_GB=1 KVSHARE_DTYPE=float32
stalls=0
for ((i = 1; i <= TRIALS; i++)); do
  port=$((20000 + (RANDOM % 500) * 3))
  rm -f "$DIR/server.log"
  "$PY" perf/server/fullstack_server.py start --ports "$port,$((port + 1)),$((port + 2))" --models llm_engine \
      --log "$DIR/server.log" --pid-file "$DIR/server.pid" > "$DIR/start.txt" 2>&1 \
      || { echo "trial $i: the server did not start (see $DIR/start.txt, $DIR/server.log)"; exit 1; }
  "$PY" -m perf.load.serving_load --target triton --url "127.0.0.1:$((port + 1))" --model llm_engine \
      --trace fixed-64 --requests "$N" --concurrency "$C" --vocab 256 --output-tokens "$T" > "$DIR/load.txt" 2>&1 \
      || echo "trial $i: the load reported errors (see $DIR/load.txt)"
  "$PY" perf/server/fullstack_server.py stop --pid-file "$DIR/server.pid" > /dev/null 2>&1 || true
  if grep -q "Exit timeout expired" "$DIR/server.log"; then
    stalls=$((stalls + 1)); verdict=stall
  elif grep -q "kvshare engine stopped" "$DIR/server.log"; then
    verdict=clean
  else
    verdict="neither (see $DIR/server.log)"
  fi
  echo "trial $i/$TRIALS: $verdict"
done
echo "stalled at shutdown: $stalls of $TRIALS trials ($N requests, $C at a time, $T tokens each; logs in $DIR)"
