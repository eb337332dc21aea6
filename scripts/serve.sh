#!/usr/bin/env bash
# Sets everything up (idempotent) and serves model_repository/ with the embedded default model
# (SmolLM2-135M-Instruct, CPU) on ports 8000 (HTTP), 8001 (gRPC), 8002 (metrics).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m kvshare.launch --model-repository model_repository "$@"
