#!/usr/bin/env bash
# What `vllm serve` imports beyond the offline bundle (../shared/tools/vllm-h200/build_bundle.sh) and
# the H200 image (anyio, click, h11, httpx, prometheus-client, uvloop are there): cp312 / pure wheels
# into .carry/vllm/serve (under 1 MB); perf/peer/unpack_vllm.sh installs them into /tmp/site when the
# command carries that folder beside piece 2. Found by walking the imports of vllm.entrypoints.cli.main
# and vllm.entrypoints.openai.api_server (module level) plus the routers they build (metrics, forms).
#   bash perf/peer/build_serve_wheels.sh [OUT]        # from the checkout's root
set -euo pipefail
OUT=${1:-.carry/vllm/serve}
rm -rf "$OUT" && mkdir -p "$OUT"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT" uvicorn==0.54.0 watchfiles==1.3.0 model-hosting-container-standards==0.1.16 \
    prometheus-fastapi-instrumentator==8.1.0 python-multipart==0.0.34 jmespath==1.1.0 supervisor==4.3.0
du -sh "$OUT"
