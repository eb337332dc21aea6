#!/usr/bin/env bash
# Streaming concurrency sweep with perf_analyzer; one profile export per concurrency, then
# TTFT / inter-token latency percentiles from the exported response timestamps.
#
#   perf/load/pa_sweep.sh [-m llm_engine|ensemble] [-u host:grpc_port] [-c "1 2 4 8 16"]
#                             [-i input.json] [-o out_dir] [-- extra perf_analyzer options]
#
# Without -i, inputs are generated: synthetic token ids for llm_engine (128 ids -> 64 forced
# tokens), built-in text prompts for the ensemble. Each level sends a fixed number of requests
# (REQUESTS_PER_LEVEL, default 16 x concurrency, at least 32) rather than waiting for perf_analyzer's
# stability criterion, which a noisy shared machine may never meet (it then aborts).
# Writes OUT/c<N>.json (profile export), OUT/c<N>.csv (perf_analyzer's summary),
# OUT/sweep.csv (percentiles) and prints a table.
# Exit code: non-zero when perf_analyzer failed or any request got no response.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
MODEL=llm_engine URL=127.0.0.1:8001 CONC="1 2 4 8 16" INPUT="" OUT=""
while getopts "m:u:c:i:o:h" opt; do
  case $opt in
    m) MODEL=$OPTARG ;; u) URL=$OPTARG ;; c) CONC=$OPTARG ;; i) INPUT=$OPTARG ;; o) OUT=$OPTARG ;;
    h) sed -n '2,14p' "$0"; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
OUT=${OUT:-$ROOT/runs/pa-$MODEL-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
if [ -z "$INPUT" ]; then
  INPUT=$OUT/inputs.json
  if [ "$MODEL" = ensemble ]; then
    "$PY" "$HERE/make_pa_inputs.py" text -o "$INPUT" --max-tokens 64
  else
    "$PY" "$HERE/make_pa_inputs.py" tokens -o "$INPUT" --count 64 --input-len 128 --max-tokens 64 --min-tokens 64
  fi
fi
exports=()
for c in $CONC; do
  n=${REQUESTS_PER_LEVEL:-$(( c * 16 > 32 ? c * 16 : 32 ))}
  echo "== $MODEL concurrency $c: $n requests" >&2
  "$HERE/perf_analyzer.sh" -m "$MODEL" -u "$URL" -i grpc --streaming \
    --concurrency-range "$c:$c" --input-data "$INPUT" --request-count "$n" \
    --profile-export-file "$OUT/c$c.json" -f "$OUT/c$c.csv" "$@" >"$OUT/c$c.log" 2>&1 \
    || { tail -20 "$OUT/c$c.log" >&2; echo "perf_analyzer failed at concurrency $c (log: $OUT/c$c.log)" >&2; exit 1; }
  exports+=("$OUT/c$c.json")
done
"$PY" "$HERE/pa_export_stats.py" "${exports[@]}" --csv "$OUT/sweep.csv"
echo "results: $OUT" >&2
