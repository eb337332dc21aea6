#!/usr/bin/env bash
# FlashAttention 3 alone, from the vLLM bundle (.carry/vllm/p1 + p2, ../shared/tools/vllm-h200/build_bundle.sh):
# vLLM's Python files and its FA3 library, ~12 MiB, small enough to travel in one device command beside the
# working tree. The kernel benches' FA3 column (bench_prefill_ceiling.py, bench_peer_attention.py's prefill)
# needs nothing else; FlashInfer's decode and the vLLM engines still need the whole bundle.
#   bash perf/peer/build_fa3_bundle.sh            # -> .carry/fa3/{vllm-py.tar.xz,fa3.xz}
# On the GPU machine: bash perf/peer/unpack_fa3.sh, then PYTHONPATH=/tmp/site.
set -euo pipefail
B=${1:-.carry/vllm}
OUT=${2:-.carry/fa3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat "$B"/p1/bundle.part.* "$B"/p2/bundle.part.* > "$work/bundle.tar"
[ "$(sha256sum "$work/bundle.tar" | cut -d' ' -f1)" = "$(cat "$B/p2/bundle.sha256")" ] \
    || { echo "bundle sha256 mismatch under $B"; exit 1; }
tar xf "$work/bundle.tar" -C "$work" rest.tar.xz fa3.xz
mkdir -p "$work/site" "$OUT"
tar xJf "$work/rest.tar.xz" -C "$work/site" --wildcards ./vllm './vllm-*.dist-info'
# the dist-info too: vLLM finds its platform (and so FA3's compute capability check) through its metadata
(cd "$work/site" && find vllm vllm-*.dist-info -type f \( -name '*.py' -o -path '*dist-info*' \) -print0 | sort -z \
    | tar cf - --null -T - | xz -T0 -6 > "$work/vllm-py.tar.xz")
mv "$work/vllm-py.tar.xz" "$work/fa3.xz" "$OUT/"
echo "$OUT: $(du -sh "$OUT" | cut -f1) ($(ls "$OUT" | tr '\n' ' '))"
