#!/usr/bin/env bash
# Headless Locust run against kvshare with SLO gates; writes CSV and HTML reports.
#
#   perf/load/run_locust.sh [-H host:grpc_port] [-u users] [-r spawn_rate] [-t duration]
#                               [-o out_dir] [-- extra locust/kvshare options]
#
# Example: perf/load/run_locust.sh -u 16 -t 2m -- --kvshare-model llm_engine \
#              --kvshare-max-tokens 128 --kvshare-min-tokens 128 --kvshare-slo-p95-ttft-ms 2000
# Exit code: 0 when the SLO gates pass (--kvshare-slo-max-failure-ratio, default 0;
# --kvshare-slo-p95-ttft-ms, default off), 1 when a gate fails, other values when Locust itself failed.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
HOST=127.0.0.1:8001 USERS=8 RATE=8 DURATION=60s OUT=""
while getopts "H:u:r:t:o:h" opt; do
  case $opt in
    H) HOST=$OPTARG ;; u) USERS=$OPTARG ;; r) RATE=$OPTARG ;; t) DURATION=$OPTARG ;; o) OUT=$OPTARG ;;
    h) sed -n '2,11p' "$0"; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
OUT=${OUT:-$ROOT/runs/locust-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
LOCUST=${LOCUST:-$ROOT/.venv/bin/locust}
[ -x "$LOCUST" ] || LOCUST=locust
set +e
"$LOCUST" -f "$HERE/locustfile.py" --headless --host "$HOST" -u "$USERS" -r "$RATE" -t "$DURATION" \
  --only-summary --stop-timeout 30 --csv "$OUT/locust" --csv-full-history --html "$OUT/report.html" "$@"
rc=$?
set -e
echo "reports: $OUT/locust_stats.csv $OUT/report.html (exit code $rc)" >&2
exit $rc
