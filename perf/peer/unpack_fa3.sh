#!/usr/bin/env bash
# On the GPU machine, in a command that carries .carry/fa3 (perf/peer/build_fa3_bundle.sh): vLLM's Python
# files and FA3's library into $SITE, so that PYTHONPATH=$SITE imports vllm.vllm_flash_attn (nothing else of
# vLLM: its other libraries stay behind).
set -euo pipefail
B=${1:-.carry/fa3}
SITE=${VLLM_SITE:-/tmp/site}
[ -f "$B/fa3.xz" ] || { echo "no $B/fa3.xz: bash perf/peer/build_fa3_bundle.sh here, and carry $B"; exit 1; }
mkdir -p "$SITE"
tar xJf "$B/vllm-py.tar.xz" -C "$SITE"
xz -dc "$B/fa3.xz" > "$SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
chmod 755 "$SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
# vLLM's CUDA platform (which FA3's capability check asks) imports its main op library only to register
# ops; FA3's call uses none of them, so an empty module stands in for the 53 MB it would take to carry
[ -e "$SITE/vllm/_C_stable_libtorch.abi3.so" ] || echo '"""Stand-in: FA3 alone (perf/peer/unpack_fa3.sh)."""' > "$SITE/vllm/_C_stable_libtorch.py"
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 python3 -c \
    "from vllm.vllm_flash_attn import flash_attn_interface as f; print('FA3', f.is_fa_version_supported(3), f.fa_version_unsupported_reason(3) or '')"
