#!/usr/bin/env bash
# The whole stack on the GPU machine, from the repo root: the real Triton 2.51 server on
# model_repository/ (llm_engine, the kvshare engine on cuda:0) driven over gRPC streaming by
# perf_analyzer and by the project's own async client, then the offline engine on the same requests.
#
#   bash perf/server/make_fullstack_bundle.sh        # here (CPU machine): fills .carry/fullstack
#   python3 -m perf.gpu fullstack                    # there, with .carry/fullstack carried (runs this script)
#   FULLSTACK_LOCAL=1 bash perf/server/fullstack.sh  # dry run on the CPU machine (repo .venv, tiny model)
#
# Stages (each under `timeout`, each prints "[stage NAME rc=N, S s]"; a failed stage does not stop
# the ones that do not need it; the whole run stays inside FULLSTACK_BUDGET_S, default 510 s):
#   env      build the numpy<2 virtualenv from the bundle (python3 perf/gpu/env.py server-venv)
#   check    import numpy/torch/tritonclient.grpc/kvshare; perf_analyzer --version
#   server   tritonserver via kvshare.launch (perf/server/fullstack_server.py), only llm_engine loaded,
#            engine settings through KVSHARE_* (device cuda, dummy:llama-2-7b fp16, 40 GB KV, ...)
#   warmup   one request per slot, 16 tokens (kernel compilation, allocator, streams)
#   pa       perf_analyzer --streaming, concurrency C, N requests (perf/server/fullstack_pa.py)
#   client-P the kvshare async client, concurrency C over P processes (fullstack_client_load.py)
#   stop     the server (frees the GPU)
#   offline  perf/engine/offline_benchmark.py on the same N requests, same engine settings (fullstack_offline.py)
#   summary  table + summary.json/summary.md (fullstack_summary.py); ratio server/offline, goal >= 0.85
# Workload: offline_benchmark's fixed-C shape: N distinct prompts of L ids -> exactly M tokens
# (ignore_eos, greedy) to llm_engine as token ids. GPU defaults: N=256, C=64, L=M=128.
# $OUT (default /tmp/fullstack-out) gets fullstack.log, summary.md, summary.json, server.log and
# details.tar.gz (every stage's files); the work dir is FULLSTACK_WORK (default /tmp/kvshare-fullstack).
# Overrides: FULLSTACK_{REQUESTS,CONCURRENCY,INPUT_LEN,OUTPUT_LEN,MODEL,VOCAB,DEVICE,DTYPE,KV_GB,
# MAX_RUNNING,MAX_STEP_TOKENS,MAX_PREFILL_CHUNK,CLIENT_PROCS,BUDGET_S}; FULLSTACK_ENV=bundle with
# FULLSTACK_LOCAL=1 builds the environment from FULLSTACK_BUNDLE (a PYVER=3.11 bundle) to test `env`.
set -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-/tmp/fullstack-out}
WORK=${FULLSTACK_WORK:-/tmp/kvshare-fullstack}
LOCAL=${FULLSTACK_LOCAL:-0}
RUN=$WORK/run
mkdir -p "$OUT" "$RUN"
rm -rf "${RUN:?}"/* "$OUT/details.tar.gz"
exec > >(tee "$OUT/fullstack.log") 2>&1
TEE_PID=$!
eval "$(python3 perf/gpu/env.py)"   # the repo's packages on PYTHONPATH (nothing is installed on the GPU machine)
T_START=$SECONDS
BUDGET=${FULLSTACK_BUDGET_S:-510}

if [ "$LOCAL" = 1 ]; then
  D_REQ=16 D_CONC=4 D_LEN=32 D_MODEL=dummy:tiny-llama D_VOCAB=256 D_DEV=cpu D_DTYPE=float32 D_KV=0.25
  D_RUN=16 D_PROCS="1 2" D_ENV=venv
  # 2 shared cores: OpenMP threads fighting other processes made the CPU engine ~100x slower.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  D_REQ=256 D_CONC=64 D_LEN=128 D_MODEL=dummy:llama-2-7b D_VOCAB=32000 D_DEV=cuda D_DTYPE=float16 D_KV=40
  D_RUN=256 D_PROCS="1 4" D_ENV=bundle
fi
REQUESTS=${FULLSTACK_REQUESTS:-$D_REQ}
CONC=${FULLSTACK_CONCURRENCY:-$D_CONC}
INPUT_LEN=${FULLSTACK_INPUT_LEN:-$D_LEN}
OUTPUT_LEN=${FULLSTACK_OUTPUT_LEN:-$D_LEN}
MODEL=${FULLSTACK_MODEL:-$D_MODEL}
VOCAB=${FULLSTACK_VOCAB:-$D_VOCAB}
DEVICE=${FULLSTACK_DEVICE:-$D_DEV}
DTYPE=${FULLSTACK_DTYPE:-$D_DTYPE}
KV_GB=${FULLSTACK_KV_GB:-$D_KV}
MAX_RUNNING=${FULLSTACK_MAX_RUNNING:-$D_RUN}
STEP_TOKENS=${FULLSTACK_MAX_STEP_TOKENS:-4096}
PREFILL_CHUNK=${FULLSTACK_MAX_PREFILL_CHUNK:-2048}
CLIENT_PROCS=${FULLSTACK_CLIENT_PROCS:-$D_PROCS}
ENV_MODE=${FULLSTACK_ENV:-$D_ENV}
BUNDLE=${FULLSTACK_BUNDLE:-$ROOT/.carry/fullstack}
SERVER_PID_FILE=$RUN/server.pid

left() { echo $((BUDGET - (SECONDS - T_START))); }
# cap WANT [RESERVE]: WANT seconds, or what is left of the budget minus RESERVE if that is less.
cap() { local l=$(($(left) - ${2:-0})); if [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi; }
stage() {
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 5 ]; then echo "[stage $name skipped: out of time]"; return 124; fi
  echo "== $name (limit ${limit} s, $(left) s of the budget left)"
  local t0=$SECONDS
  # In the background + wait, so that INT/TERM reach the trap at once (bash defers traps while a
  # foreground command runs).
  timeout -k 10 "$limit" "$@" &
  STAGE_PID=$!
  wait "$STAGE_PID"
  local rc=$?
  STAGE_PID=""
  echo "[stage $name rc=$rc, $((SECONDS - t0)) s]"
  return $rc
}
STAGE_PID=""
stop_server() {
  [ -f "$SERVER_PID_FILE" ] || return 0
  local pg; pg=$(cat "$SERVER_PID_FILE"); rm -f "$SERVER_PID_FILE"
  [ -n "$pg" ] && kill -0 -- "-$pg" 2>/dev/null || return 0
  kill -INT -- "-$pg" 2>/dev/null
  for _ in $(seq 1 150); do
    kill -0 -- "-$pg" 2>/dev/null || { echo "server $pg stopped"; return 0; }
    # tritonserver gone (its --exit-timeout-secs ran out) but its stub still there: kill the stub.
    [ -d "/proc/$pg" ] && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$pg/stat" 2>/dev/null || break
    sleep 0.2
  done
  kill -KILL -- "-$pg" 2>/dev/null
  for _ in $(seq 1 50); do kill -0 -- "-$pg" 2>/dev/null || break; sleep 0.1; done
  echo "server $pg killed"
}
FINISHED=0
finish() {
  [ "$FINISHED" = 1 ] && return 0
  FINISHED=1
  stop_server
  [ -f "$RUN/server.log" ] && cp "$RUN/server.log" "$OUT/server.log"
  [ -f "$OUT/summary.md" ] || ${PY:-python3} perf/server/fullstack_summary.py --work "$RUN" --out "$OUT" >/dev/null 2>&1
  tar -czf "$OUT/details.tar.gz" -C "$WORK" run 2>/dev/null
  echo "results in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')($(du -sh "$OUT" | cut -f1)); total $((SECONDS - T_START)) s"
  exec >&- 2>&-
  wait "$TEE_PID" 2>/dev/null
}
trap finish EXIT
on_signal() {
  echo "interrupted"
  [ -n "$STAGE_PID" ] && kill -TERM "$STAGE_PID" 2>/dev/null
  exit 130
}
trap on_signal INT TERM

echo "kvshare full-stack run: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | grep -c .) local changes"
echo "workload: $REQUESTS requests, concurrency $CONC, $INPUT_LEN ids -> $OUTPUT_LEN tokens (ignore_eos, greedy); model $MODEL $DTYPE on $DEVICE, KV $KV_GB GB"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 | tee "$RUN/gpu.txt"

# ------------------------------------------------------------------ env + check
if [ "$ENV_MODE" = bundle ]; then
  stage env "$(cap 150 200)" "${FULLSTACK_PYTHON:-python3}" perf/gpu/env.py server-venv "$BUNDLE" "$WORK/env"
  ENV_RC=$?
  # shellcheck disable=SC1091
  [ -f "$WORK/env/activate.sh" ] && [ "$ENV_RC" = 0 ] && . "$WORK/env/activate.sh"
else
  PY=$ROOT/.venv/bin/python PA=$ROOT/perf/load/perf_analyzer.sh PA_LD=""
  [ -x "$PY" ] || { echo "no .venv: run scripts/setup.sh"; exit 1; }
  ENV_RC=0
fi
CHECK_PY='import sys, numpy, torch, tritonclient.grpc, kvshare, kvshare_client, kvshare.launch as launch
print(sys.executable, sys.version.split()[0], "numpy", numpy.__version__, "torch", torch.__version__,
      "cuda", torch.cuda.is_available(), "server", launch.tritonserver_dir())
assert numpy.__version__.startswith("1."), "numpy must be < 2 in the 2.51 python backend"
assert sys.argv[1] == "cpu" or torch.cuda.is_available(), "CUDA is not available to torch"'
CHECK_RC=1 PA_RC=1
if [ -n "${PY:-}" ]; then
  stage check-python "$(cap 90 200)" "$PY" -c "$CHECK_PY" "$DEVICE"
  CHECK_RC=$?
  stage check-pa 20 env LD_LIBRARY_PATH="${PA_LD}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$PA" --version
  PA_RC=$?
fi
OFFPY=${PY:-python3}
if [ "$CHECK_RC" != 0 ] && [ "$LOCAL" != 1 ]; then
  # The offline engine does not need the bundle: the image's python3 runs it (PYTHONPATH from perf/gpu/env.py).
  OFFPY=python3
fi

# ------------------------------------------------------------------ server + load
read -r HTTP_PORT GRPC_PORT METRICS_PORT < <(${PY:-python3} -c '
import socket
ss = [socket.socket() for _ in range(3)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in ss])')
URL=127.0.0.1:$GRPC_PORT
MURL=http://127.0.0.1:$METRICS_PORT/metrics
RESERVE=200   # seconds kept for stop + offline + summary
SERVER_RC=1
if [ "$CHECK_RC" = 0 ]; then
  limit=$(cap 300 "$RESERVE")
  stage server "$limit" env KVSHARE_DEVICE="$DEVICE" KVSHARE_MODEL="$MODEL" KVSHARE_DTYPE="$DTYPE" \
    KVSHARE_KV_CACHE_MEMORY_GB="$KV_GB" KVSHARE_MAX_RUNNING="$MAX_RUNNING" KVSHARE_MAX_STEP_TOKENS="$STEP_TOKENS" \
    KVSHARE_MAX_PREFILL_CHUNK="$PREFILL_CHUNK" KVSHARE_PAGE_SIZE=16 KVSHARE_DEBUG_CHECKS=false KVSHARE_LOG_LEVEL=INFO \
    "$PY" perf/server/fullstack_server.py start --ports "$HTTP_PORT,$GRPC_PORT,$METRICS_PORT" --models llm_engine \
    --log "$RUN/server.log" --pid-file "$SERVER_PID_FILE" --ready-timeout $((limit - 15))
  SERVER_RC=$?
  grep -E "starting the kvshare engine|kvshare engine ready|captured .* CUDA graphs|Error|error:" "$RUN/server.log" | head -20
fi
LOAD=(--url "$URL" --metrics-url "$MURL" --concurrency "$CONC" --input-len "$INPUT_LEN" --vocab "$VOCAB")
if [ "$SERVER_RC" = 0 ]; then
  stage warmup "$(cap 120 "$RESERVE")" "$PY" perf/server/fullstack_client_load.py "${LOAD[@]}" --warmup \
    --requests "$CONC" --output-len $((OUTPUT_LEN < 16 ? OUTPUT_LEN : 16)) --seed 1 --cache-salt warmup
  [ "$PA_RC" = 0 ] && stage pa "$(cap 150 "$RESERVE")" "$PY" perf/server/fullstack_pa.py "${LOAD[@]}" --pa "$PA" --pa-ld-path "$PA_LD" \
    --requests "$REQUESTS" --output-len "$OUTPUT_LEN" --cache-salt pa --timeout 140 --out-dir "$RUN/pa"
  for P in $CLIENT_PROCS; do
    stage "client-$P" "$(cap 120 "$RESERVE")" "$PY" perf/server/fullstack_client_load.py "${LOAD[@]}" --processes "$P" \
      --requests "$REQUESTS" --output-len "$OUTPUT_LEN" --cache-salt "client-$P" --out-json "$RUN/client_p$P.json"
  done
  "$PY" -c "from kvshare_client.metrics import fetch_metrics, filter_lines
print('\n'.join(l for l in filter_lines(fetch_metrics('$MURL')) if not l.startswith('#')))" >"$RUN/metrics_end.txt" 2>&1
fi
t0=$SECONDS; stop_server; echo "[stage stop rc=0, $((SECONDS - t0)) s]"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used --format=csv,noheader

# ------------------------------------------------------------------ offline reference
stage offline "$(cap 240 15)" "$OFFPY" perf/server/fullstack_offline.py --requests "$REQUESTS" --concurrency "$CONC" \
  --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --vocab "$VOCAB" -- --model "$MODEL" --device "$DEVICE" \
  --dtype "$DTYPE" --kv-gb "$KV_GB" --max-step-tokens "$STEP_TOKENS" --max-prefill-chunk "$PREFILL_CHUNK" \
  --max-running "$MAX_RUNNING" --json "$RUN/offline.json" > >(grep --line-buffered -v "it/s]") 2>&1
OFFLINE_RC=$?

# ------------------------------------------------------------------ summary
GPU_NAME=$(head -2 "$RUN/gpu.txt" 2>/dev/null | tail -1 | cut -d, -f1-2)
stage summary 30 "$OFFPY" perf/server/fullstack_summary.py --work "$RUN" --out "$OUT" \
  --info "machine=${GPU_NAME:-$(uname -n) (no GPU)}" \
  --info "workload=$REQUESTS requests x $INPUT_LEN ids -> $OUTPUT_LEN tokens, concurrency $CONC, greedy, ignore_eos; token ids to llm_engine" \
  --info "engine=$MODEL $DTYPE on $DEVICE, KV $KV_GB GB, page 16, max_step_tokens $STEP_TOKENS, max_prefill_chunk $PREFILL_CHUNK; max_running $MAX_RUNNING (server and offline)" \
  --info "server=Triton 2.51 (nvidia-pytriton), python backend, llm_engine only (explicit model control), instance KIND_CPU with KVSHARE_DEVICE=$DEVICE" \
  --info "stages=env $ENV_RC, check python $CHECK_RC, check perf_analyzer $PA_RC, server $SERVER_RC, offline $OFFLINE_RC"
finish
# 0 when both sides produced numbers (the verdict is in the table), 1 otherwise.
[ "$SERVER_RC" = 0 ] && [ "$OFFLINE_RC" = 0 ]
