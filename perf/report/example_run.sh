#!/usr/bin/env bash
# The example report's run, end to end, against real servers started here (ports 18200-18202 by default):
#   1. perf/server/server_benchmark.py (starts and stops its own server; kvshare vs HF generate / generate_batch)
#   2. a server of our own + the metrics sampler, a short Locust run, a perf_analyzer sweep; server stopped
#   3. python -m perf.report over everything -> OUT/README.md + PNGs (+ the inputs under OUT/data/)
#
#   perf/report/example_run.sh [-o docs/reports/example] [-r runs/example] [-p 18200] [-t 60s] [-u 8] [-c "1 2 4 8"]
# Scale (defaults fit ~8 minutes on 2 CPU cores): SB_ARGS="--requests 96 --output-tokens 128",
# REQUESTS_PER_LEVEL (perf_analyzer, default 16), MAX_TOKENS (Locust and perf_analyzer, default 32).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$ROOT/.venv/bin/python}
OUT=docs/reports/example RUN=runs/example PORT=18200 DURATION=60s USERS=8 CONC="1 2 4 8"
while getopts "o:r:p:t:u:c:h" opt; do
  case $opt in
    o) OUT=$OPTARG ;; r) RUN=$OPTARG ;; p) PORT=$OPTARG ;; t) DURATION=$OPTARG ;; u) USERS=$OPTARG ;; c) CONC=$OPTARG ;;
    h) sed -n '2,9p' "$0"; exit 0 ;;
    *) exit 2 ;;
  esac
done
HTTP=$PORT GRPC=$((PORT + 1)) METRICS=$((PORT + 2))
MAX_TOKENS=${MAX_TOKENS:-32}
export REQUESTS_PER_LEVEL=${REQUESTS_PER_LEVEL:-16}
WL=runs/workloads
mkdir -p "$RUN"
"$PY" -m perf.workloads.generate -o "$WL" --workloads seed-12x128,seed-hot10 >/dev/null

if [ -z "${SKIP_SERVER_BENCH:-}" ]; then
  "$PY" perf/server/server_benchmark.py --ports "$HTTP,$GRPC,$METRICS" -o "$RUN/server-bench" ${SB_ARGS:-}
fi

echo "== starting our own server on gRPC $GRPC for Locust + perf_analyzer" >&2
"$PY" -m kvshare.launch --model-repository model_repository --http-port "$HTTP" --grpc-port "$GRPC" \
  --metrics-port "$METRICS" >"$RUN/live-server.log" 2>&1 &
LAUNCH=$!
SAMPLER=""
# SIGTERM, not SIGINT: a background job of a non-interactive shell starts with SIGINT ignored.
cleanup() {
  [ -n "$SAMPLER" ] && kill -TERM "$SAMPLER" 2>/dev/null && wait "$SAMPLER" 2>/dev/null || true
  kill -TERM "$LAUNCH" 2>/dev/null && wait "$LAUNCH" 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$HTTP/v2/health/ready" >/dev/null 2>&1 && break
  kill -0 "$LAUNCH" 2>/dev/null || { tail -30 "$RUN/live-server.log" >&2; exit 1; }
  sleep 1
done
mkdir -p "$RUN/live"
"$PY" -m perf.report.metrics_sampler --url "http://127.0.0.1:$METRICS/metrics" -o "$RUN/live/metrics.csv" &
SAMPLER=$!
phase() { "$PY" -c "import json,sys,time; p=sys.argv[1]; d=json.load(open(p)) if __import__('os').path.exists(p) else []; \
d.append({'label': sys.argv[2], 'start_unix': float(sys.argv[3]), 'end_unix': time.time()}); json.dump(d, open(p, 'w'), indent=1)" \
  "$RUN/live/phases.json" "$1" "$2"; }
rm -f "$RUN/live/phases.json"

t0=$(date +%s.%N)
perf/load/run_locust.sh -H "127.0.0.1:$GRPC" -u "$USERS" -r "$USERS" -t "$DURATION" -o "$RUN/locust" -- \
  --kvshare-model llm_engine --kvshare-workload "$WL/seed-hot10.ids.jsonl" --kvshare-max-tokens "$MAX_TOKENS" \
  --kvshare-min-tokens "$MAX_TOKENS" --kvshare-ignore-eos || echo "Locust exit code $? (SLO gate or failure)" >&2
phase "Locust $USERS users" "$t0"

"$PY" perf/load/make_pa_inputs.py text -o "$RUN/pa-inputs.json" --workload "$WL/seed-hot10.ids.jsonl" \
  --max-tokens "$MAX_TOKENS" --min-tokens "$MAX_TOKENS" --ignore-eos
for c in $CONC; do
  t0=$(date +%s.%N)
  perf/load/pa_sweep.sh -m llm_engine -u "127.0.0.1:$GRPC" -c "$c" -i "$RUN/pa-inputs.json" -o "$RUN/pa/c$c"
  phase "PA c=$c" "$t0"
done
cleanup
trap - EXIT
# one sweep directory for the report: the per-level exports side by side
mkdir -p "$RUN/pa-sweep" && for c in $CONC; do cp "$RUN/pa/c$c/c$c.json" "$RUN/pa-sweep/"; done
"$PY" -m perf.report "$RUN/server-bench" "$RUN/live" "$RUN/locust" "$RUN/pa-sweep" -o "$OUT" --copy-data \
  --title "kvshare example report (CPU, SmolLM2-135M, 2 cores)"
