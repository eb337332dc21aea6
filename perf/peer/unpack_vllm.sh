#!/usr/bin/env bash
# vLLM on the GPU machine from the bundle that ../shared/tools/vllm-h200/build_bundle.sh makes here
# (.carry/vllm: p1/bundle.part.aa, p2/bundle.part.ab + bundle.sha256). One device command carries one
# piece; /tmp survives while the machine stays warm, so the pieces meet in $STAGE:
#   bash perf/peer/unpack_vllm.sh        # with piece 1: stages it; with piece 2: checks, unpacks into $SITE
#                                        # (and installs .carry/vllm/serve/*.whl there when carried)
# Then PYTHONPATH=$SITE imports vllm (perf/gpu/suites.py's `peer` stages put it first).
set -euo pipefail
B=${1:-.carry/vllm}
STAGE=${VLLM_STAGE:-/tmp/vw}
SITE=${VLLM_SITE:-/tmp/site}
mkdir -p "$STAGE"
shopt -s nullglob
parts=("$B"/p*/bundle.part.*)
[ ${#parts[@]} -gt 0 ] || { echo "no bundle piece under $B: carry .carry/vllm/p1 (first command) or .carry/vllm/p2"; exit 1; }
cp "${parts[@]}" "$STAGE/"
if [ ! -f "$B/p2/bundle.sha256" ]; then
    echo "staged in $STAGE: $(cd "$STAGE" && ls bundle.part.*); carry .carry/vllm/p2 in the next command"
    exit 0
fi
[ -f "$STAGE/bundle.part.aa" ] || { echo "piece 1 is not in $STAGE: the command carrying .carry/vllm/p1 must run first on this warm machine"; exit 1; }
cat "$STAGE"/bundle.part.* > "$STAGE/bundle.tar"
want=$(cat "$B/p2/bundle.sha256")
got=$(sha256sum "$STAGE/bundle.tar" | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "bundle sha256 $got, expected $want: pieces of two different builds?"; exit 1; }
rm -rf "$SITE" && mkdir -p "$SITE"
tar xf "$STAGE/bundle.tar" -C "$STAGE"
tar xJf "$STAGE/rest.tar.xz" -C "$SITE"
# the two largest libraries travel apart, each xz-compressed on its own
xz -dc "$STAGE/c.xz" > "$SITE/vllm/_C_stable_libtorch.abi3.so"
xz -dc "$STAGE/fa3.xz" > "$SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
chmod 755 "$SITE"/vllm/*.so "$SITE"/vllm/vllm_flash_attn/*.so
serve=("$B"/serve/*.whl)
if [ ${#serve[@]} -gt 0 ]; then    # `vllm serve`'s extra packages (perf/peer/build_serve_wheels.sh), when carried
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${serve[@]}"
    echo "installed ${#serve[@]} serving wheels into $SITE"
fi
echo "unpacked into $SITE: $(du -sh "$SITE" | cut -f1)"
if [ "${VLLM_UNPACK_NO_IMPORT:-0}" != 1 ]; then
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 python3 -c \
        "import vllm, vllm.vllm_flash_attn as fa, flashinfer; print('vllm', vllm.__version__, 'FA3', fa.FA3_AVAILABLE, 'flashinfer', flashinfer.__version__)"
fi
