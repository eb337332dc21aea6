# Sourced by the perf/gpu/*.sh drivers (set OUT_DEFAULT first): the repo root as working directory,
# the environment every stage needs, $OUT for logs, and `stage CMD...`, which runs CMD and prints
# "[stage rc=N, S s]" (a failing stage does not stop the next one).
set -o pipefail
OUT=${OUT:-$OUT_DEFAULT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
stage() { local t0=$SECONDS; "$@"; local rc=$?; echo "[stage rc=$rc, $((SECONDS - t0)) s]"; return $rc; }
quiet() { grep --line-buffered -v "it/s]"; }     # drop tqdm progress lines from the logs
# BENCH_EXTRA: flags added to every offline run (e.g. --step-profile)
OFFLINE_7B="python3 perf/offline_benchmark.py --model dummy:llama-2-7b --device cuda ${BENCH_EXTRA:-}"
