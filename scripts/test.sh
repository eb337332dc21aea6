#!/usr/bin/env bash
# Sets everything up (idempotent) and runs the whole test suite: unit, engine, kernels (Triton
# interpreter on the CPU), client, and integration tests against the real Triton server.
# GPU-only tests skip without CUDA. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/setup_genai_perf.sh || echo "[test] genai-perf could not be set up: tests/backend/integration/test_genai_perf.py will say why"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -ra --durations=15 "$@"
