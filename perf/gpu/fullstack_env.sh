#!/usr/bin/env bash
# Builds the full-stack run's Python environment on the GPU machine from the carried bundle
# (.carry/fullstack, made by perf/gpu/make_fullstack_bundle.sh), by environment.md's recipe:
#   - a virtualenv made with --without-pip from the image's python3 (Python 3.12 there);
#   - the bundle's cp312 packages (numpy 1.26.4, python-rapidjson, protobuf<5, tritonclient 2.51 with
#     perf_analyzer), pre-installed here with `pip install --no-deps --target`, unpacked into its
#     site-packages, so they come first;
#   - the Triton 2.51 server (pytriton/tritonserver + nvidia_pytriton.libs) unpacked beside them,
#     with the python-backend stub of this Python in backends/python/;
#   - .pth files: hide sklearn/scipy (built for numpy 2 in the image), then add the image's own
#     site-packages AFTER ours (torch, triton, transformers...), then the repo's src/;
#   - perf_analyzer's libraries in ENV/palib: libcudart.so.12 from the nvidia-cuda-runtime-cu12
#     wheel and libb64.so.0d from the Debian package (dpkg -x), for LD_LIBRARY_PATH.
# Writes ENV/activate.sh (PY, PA, PA_LD). Idempotent: the environment is rebuilt from scratch.
#
#   bash perf/gpu/fullstack_env.sh BUNDLE_DIR ENV_DIR
# FULLSTACK_PYTHON: the base interpreter (default python3); FULLSTACK_IMAGE_SITE: ':'-separated
# site dirs to add after ours (default: the base interpreter's own site-packages/dist-packages).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUNDLE=$(cd "${1:?bundle dir}" && pwd)
ENVDIR=${2:?env dir}
BASEPY=${FULLSTACK_PYTHON:-python3}
log() { printf '[env %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

[ -f "$BUNDLE/MANIFEST.txt" ] || { echo "no MANIFEST.txt in $BUNDLE: run perf/gpu/make_fullstack_bundle.sh and carry .carry/fullstack" >&2; exit 1; }
PYVER=$("$BASEPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
WANT=$(sed -n 's/^python=//p' "$BUNDLE/MANIFEST.txt")
[ "$PYVER" = "$WANT" ] || { echo "the bundle is for Python $WANT but $BASEPY is $PYVER" >&2; exit 1; }
IMG_SITES=${FULLSTACK_IMAGE_SITE:-$("$BASEPY" -c 'import sys; print(":".join(p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))))')}
log "base $("$BASEPY" -c 'import sys; print(sys.executable, sys.version.split()[0])'); image site dirs: $IMG_SITES"

rm -rf "$ENVDIR"
mkdir -p "$ENVDIR/palib"
if [ "${FULLSTACK_MANUAL_VENV:-0}" = 1 ] || ! "$BASEPY" -m venv --without-pip "$ENVDIR/venv"; then
  # What `venv --without-pip` writes, by hand (for an interpreter without a working venv module).
  log "python -m venv failed or skipped: writing the virtualenv by hand"
  rm -rf "$ENVDIR/venv"
  BASE_EXE=$("$BASEPY" -c 'import os, sys; print(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))')
  mkdir -p "$ENVDIR/venv/bin" "$ENVDIR/venv/lib/python$PYVER/site-packages"
  ln -s "$BASE_EXE" "$ENVDIR/venv/bin/python"
  ln -s python "$ENVDIR/venv/bin/python3"
  ln -s python "$ENVDIR/venv/bin/python$PYVER"
  printf 'home = %s\ninclude-system-site-packages = false\nversion = %s\n' "$(dirname "$BASE_EXE")" \
    "$("$BASEPY" -c 'import platform; print(platform.python_version())')" >"$ENVDIR/venv/pyvenv.cfg"
fi
PY=$ENVDIR/venv/bin/python
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
log "venv $PY, site-packages $SITE"
tar -xJf "$BUNDLE/site.tar.xz" -C "$SITE"
tar -xJf "$BUNDLE/tritonserver.tar.xz" -C "$SITE"
TS=$SITE/pytriton/tritonserver
cp "$TS/python_backend_stubs/$PYVER/triton_python_backend_stub" "$TS/backends/python/triton_python_backend_stub"
log "Triton server unpacked ($(du -sh "$TS" | cut -f1) + libs $(du -sh "$SITE/nvidia_pytriton.libs" | cut -f1)), stub for Python $PYVER in backends/python/"

# .pth files run in name order, after the venv's site-packages is on sys.path: ours come first.
echo "import sys; [sys.modules.setdefault(m, None) for m in ('sklearn', 'scipy')]" >"$SITE/zz_fullstack_1_hide.pth"
: >"$SITE/zz_fullstack_2_image.pth"
IFS=: read -r -a dirs <<<"$IMG_SITES"
for d in "${dirs[@]}"; do
  [ -n "$d" ] && echo "import site; site.addsitedir('$d')" >>"$SITE/zz_fullstack_2_image.pth"
done
echo "$ROOT/src" >"$SITE/zz_fullstack_3_src.pth"

# perf_analyzer's libraries (only for perf_analyzer: the server bundles its own libcudart).
DEB=$(ls "$BUNDLE"/libb64-0d_*.deb | head -1)
if command -v dpkg >/dev/null; then
  dpkg -x "$DEB" "$ENVDIR/libb64"
else
  "$PY" - "$DEB" "$ENVDIR/libb64" <<'PYEOF'
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
pos = 8                                         # ar archive: "!<arch>\n", then 60-byte headers
while pos < len(data):
    name, size = data[pos:pos + 16].decode().strip().rstrip("/"), int(data[pos + 48:pos + 58])
    body = data[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(body)).extractall(sys.argv[2])
    pos += 60 + size + (size & 1)
PYEOF
fi
cp -L "$(find "$ENVDIR/libb64" -name 'libb64.so.0d*' | head -1)" "$ENVDIR/palib/libb64.so.0d"
"$PY" - "$BUNDLE" "$ENVDIR/palib" <<'PYEOF'
import glob, os, sys, zipfile
whl = glob.glob(os.path.join(sys.argv[1], "nvidia_cuda_runtime_cu12-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/lib/libcudart.so.12"))
    with open(os.path.join(sys.argv[2], "libcudart.so.12"), "wb") as f:
        f.write(z.read(name))
PYEOF
PA=$SITE/bin/perf_analyzer
chmod +x "$PA"
cat >"$ENVDIR/activate.sh" <<EOF
PY=$PY
PA=$PA
PA_LD=$ENVDIR/palib
EOF
LIBDIR=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
missing=$(LD_LIBRARY_PATH=$LIBDIR ldd "$TS/backends/python/triton_python_backend_stub" 2>&1 | grep "not found" || true)
[ -z "$missing" ] || log "WARNING: the stub misses libraries: $missing"
missing=$(LD_LIBRARY_PATH=$ENVDIR/palib ldd "$PA" 2>&1 | grep "not found" || true)
[ -z "$missing" ] || log "WARNING: perf_analyzer misses libraries: $missing"
log "ready: $ENVDIR/activate.sh"
