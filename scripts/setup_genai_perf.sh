#!/usr/bin/env bash
# Idempotent set-up of NVIDIA's genai-perf (PyPI genai-perf==0.0.16) in its own virtualenv,
# .venv-genai-perf, plus a tokenizer folder for it (the SmolLM2 tokenizer the server uses), at
# .venv-genai-perf/tokenizer. genai-perf runs the perf_analyzer binary of the project's .venv
# (tritonclient[all]==2.51): callers put .venv/bin first on PATH and .venv's
# site-packages/nvidia/cuda_runtime/lib on LD_LIBRARY_PATH (tests/backend/integration/test_genai_perf.py).
# Needs .venv (scripts/setup.sh). Fast when done already: a stamp file holds what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-genai-perf
PY=${PYTHON:-python3}
WANT="genai-perf==0.0.16 numpy<2"
log() { printf '[setup-genai-perf %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ -f "$V/.installed" ] && [ "$(cat "$V/.installed")" = "$WANT" ] && [ -x "$V/bin/genai-perf" ]; then
  log "$V is up to date"
else
  [ -x "$V/bin/python" ] || { log "creating $V with $($PY --version)"; $PY -m venv "$V"; }
  log "installing $WANT into $V (first run: a minute or two)"
  # shellcheck disable=SC2086
  "$V/bin/pip" install -q --disable-pip-version-check genai-perf==0.0.16 "numpy<2" 2>&1 \
    | grep -v "^WARNING: Location" || true
  "$V/bin/genai-perf" --version >/dev/null 2>&1 || "$V/bin/genai-perf" --help >/dev/null \
    || { log "genai-perf does not run"; exit 1; }
  echo "$WANT" >"$V/.installed"
fi

if [ ! -f "$V/tokenizer/tokenizer_config.json" ]; then
  log "saving the SmolLM2 tokenizer to $V/tokenizer"
  HF_HUB_OFFLINE=1 .venv/bin/python - "$V/tokenizer" <<'EOF'
import sys
from transformers import AutoTokenizer
from kvshare.runtime.tokenizer import default_model_source, hf_location
where, kwargs = hf_location(default_model_source())
AutoTokenizer.from_pretrained(where, **kwargs).save_pretrained(sys.argv[1])
EOF
fi
log "ready: $(cat "$V/.installed"), tokenizer at $V/tokenizer"
