#!/usr/bin/env bash
# Sets everything up (idempotent) and serves model_repository/ with the embedded default model
# (SmolLM2-135M-Instruct, CPU) on ports 8000 (HTTP), 8001 (gRPC), 8002 (metrics), and the
# OpenAI-compatible API on 9000 (http://127.0.0.1:9000/v1; KVSHARE_OPENAI=0 turns it off,
# KVSHARE_OPENAI_PORT moves it).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
openai=()
# a dummy:<shape> model has no tokenizer, which the OpenAI frontend needs for chat templates
if [ "${KVSHARE_OPENAI:-1}" != "0" ] && [[ "${KVSHARE_MODEL:-}" != dummy:* ]]; then
  openai=(--openai-port "${KVSHARE_OPENAI_PORT:-9000}")
fi
exec .venv/bin/python -m kvshare.launch --model-repository model_repository "${openai[@]}" "$@"
