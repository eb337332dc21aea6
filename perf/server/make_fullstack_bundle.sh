#!/usr/bin/env bash
# Run HERE (the CPU machine, after scripts/setup.sh): fills .carry/fullstack/ (git-ignored) with what
# the GPU machine lacks for perf/server/fullstack.sh, small enough to travel (64 MiB per call,
# working tree included):
#   tritonserver.tar.xz  the Triton 2.51 server from .venv's nvidia-pytriton (pytriton/tritonserver +
#                        nvidia_pytriton.libs) without the bundled libpython 3.13 and without the
#                        stubs of other Pythons; the stub of $PYVER is already in backends/python/
#   site.tar.xz          cp$PYVER manylinux packages, `pip install --no-deps --target` here, tests
#                        stripped: numpy 1.26.4, python-rapidjson, protobuf<5, tritonclient 2.51
#                        (its perf_analyzer in bin/; the identical perf_client dropped)
#   nvidia_cuda_runtime_cu12-*.whl   libcudart.so.12 for perf_analyzer (the GPU image has CUDA 13)
#   libb64-0d_*.deb      libb64.so.0d for perf_analyzer
#   MANIFEST.txt         python version, versions, sizes, sha256
# Downloads are cached in .carry/fullstack-src/ (not carried). Idempotent.
#
#   bash perf/server/make_fullstack_bundle.sh            # Python 3.12 (the GPU image)
#   PYVER=3.11 BUNDLE_DIR=/tmp/fs311 bash perf/server/make_fullstack_bundle.sh   # for a local test
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PYVER=${PYVER:-3.12}
BUNDLE=${BUNDLE_DIR:-$ROOT/.carry/fullstack}
CACHE=${BUNDLE_CACHE:-$ROOT/.carry/fullstack-src}
CP=cp${PYVER/./}
SP=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PINS=(numpy==1.26.4 python-rapidjson==1.25 protobuf==4.25.9 tritonclient==2.51.0)
CUDART=nvidia-cuda-runtime-cu12==12.9.79
PLAT=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do PLAT+=(--platform "$p"); done
log() { printf '[bundle %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

[ -d "$SP/pytriton/tritonserver" ] || { echo "no Triton server in .venv: run scripts/setup.sh first" >&2; exit 1; }
mkdir -p "$CACHE/$CP" "$BUNDLE"
TMP=$(mktemp -d /tmp/fullstack-bundle.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

log "downloading $CP wheels into $CACHE/$CP (cached)"
for pin in "${PINS[@]}" "$CUDART"; do
  name=${pin%%==*}; ver=${pin##*==}
  if ! ls "$CACHE/$CP/${name//-/_}-$ver-"*.whl >/dev/null 2>&1; then
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYVER" \
      --implementation cp "${PLAT[@]}" -d "$CACHE/$CP" "$pin" 2>&1 | grep -v "^WARNING: Location" || true
  fi
  ls "$CACHE/$CP/${name//-/_}-$ver-"*.whl >/dev/null 2>&1 || { echo "could not download $pin for $CP" >&2; exit 1; }
done
if ! ls "$CACHE"/libb64-0d_*.deb >/dev/null 2>&1; then
  log "apt-get download libb64-0d"
  (cd "$CACHE" && apt-get download libb64-0d 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
fi
DEB=$(ls "$CACHE"/libb64-0d_*.deb | head -1)
wheel() { ls "$CACHE/$CP/${1//-/_}-$2-"*.whl | head -1; }

# Inputs of this bundle: skip the (slow) xz steps when nothing changed.
STAMP=$( { echo "$PYVER"; sha256sum "$CACHE/$CP"/*.whl "$DEB" | cut -c1-64;
           find "$SP/pytriton/tritonserver" "$SP/nvidia_pytriton.libs" -type f -printf '%P %s\n' | sort; } | sha256sum | cut -c1-16)
if [ -f "$BUNDLE/MANIFEST.txt" ] && grep -qx "stamp=$STAMP" "$BUNDLE/MANIFEST.txt" \
   && [ -f "$BUNDLE/tritonserver.tar.xz" ] && [ -f "$BUNDLE/site.tar.xz" ]; then
  log "bundle is up to date ($BUNDLE)"
else
  rm -f "$BUNDLE"/*.tar.xz "$BUNDLE"/*.whl "$BUNDLE"/*.deb "$BUNDLE/MANIFEST.txt"
  log "staging the Triton server from $SP"
  S=$TMP/server
  mkdir -p "$S/pytriton"
  cp -a "$SP/pytriton/tritonserver" "$S/pytriton/"
  cp -a "$SP/nvidia_pytriton.libs" "$S/"
  # A regular package, so that find_spec('pytriton') finds this copy first (kvshare.launch uses it).
  echo "# kvshare fullstack bundle: only pytriton/tritonserver (the Triton server binary) travels" >"$S/pytriton/__init__.py"
  rm -f "$S"/nvidia_pytriton.libs/libpython3-*.13.so*
  for d in "$S"/pytriton/tritonserver/python_backend_stubs/*; do
    [ "$(basename "$d")" = "$PYVER" ] || rm -rf "$d"
  done
  cp "$S/pytriton/tritonserver/python_backend_stubs/$PYVER/triton_python_backend_stub" \
     "$S/pytriton/tritonserver/backends/python/triton_python_backend_stub"
  find "$S" -name __pycache__ -prune -exec rm -rf {} +
  log "compressing the server ($(du -sh "$S" | cut -f1)) with xz -9"
  tar -C "$S" -cf - . | xz -9 -T0 >"$BUNDLE/tritonserver.tar.xz"

  log "installing ${PINS[*]} for $CP into a staging site-packages"
  T=$TMP/site
  python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --only-binary=:all: \
    --python-version "$PYVER" --implementation cp "${PLAT[@]}" --target "$T" \
    "$(wheel numpy 1.26.4)" "$(wheel python-rapidjson 1.25)" "$(wheel protobuf 4.25.9)" "$(wheel tritonclient 2.51.0)" \
    2>&1 | grep -v "^WARNING: Location\|Running pip as the 'root'" || true
  [ -x "$T/bin/perf_analyzer" ] || { echo "perf_analyzer missing from the tritonclient wheel" >&2; exit 1; }
  rm -f "$T/bin/perf_client" "$T/bin/f2py"           # perf_client is a byte-identical copy of perf_analyzer
  find "$T" -type d -name tests -prune -exec rm -rf {} +
  find "$T" -name __pycache__ -prune -exec rm -rf {} +
  log "compressing the packages ($(du -sh "$T" | cut -f1)) with xz -9"
  tar -C "$T" -cf - . | xz -9 -T0 >"$BUNDLE/site.tar.xz"
  cp "$(wheel nvidia-cuda-runtime-cu12 12.9.79)" "$DEB" "$BUNDLE/"
  {
    echo "python=$PYVER"
    echo "stamp=$STAMP"
    echo "made=$(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
    echo "server=nvidia-pytriton $(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("nvidia-pytriton"))') (Triton 2.51)"
    echo "packages=${PINS[*]} $CUDART libb64-0d ($(basename "$DEB"))"
    (cd "$BUNDLE" && sha256sum -- *.tar.xz *.whl *.deb)
  } >"$BUNDLE/MANIFEST.txt"
fi

log "bundle $BUNDLE:"
ls -la "$BUNDLE"
bundle_bytes=$(du -sb "$BUNDLE" | cut -f1)
tree_bytes=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
[ -d shared ] && tree_bytes=$((tree_bytes + $(du -sb shared | cut -f1)))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
log "bundle $(mib "$bundle_bytes") + working tree $(mib "$tree_bytes") = $(mib $((bundle_bytes + tree_bytes))) (limit 64 MiB a call)"
if [ "$bundle_bytes" -gt $((56 * 1048576)) ] || [ $((bundle_bytes + tree_bytes)) -gt $((63 * 1048576)) ]; then
  echo "WARNING: over budget (aim: bundle <= 56 MiB, all < 64 MiB)" >&2
  exit 1
fi
log "on the device: carry .carry/fullstack and run: python3 -m perf.gpu fullstack"
