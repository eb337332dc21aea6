#!/usr/bin/env bash
# Run the perf_analyzer binary that tritonclient 2.51's wheel ships, with the libraries it needs.
#
#   perf/load/perf_analyzer.sh -m llm_engine -u 127.0.0.1:8001 -i grpc --streaming ...
#
# All arguments go to perf_analyzer unchanged. It links libcudart.so.12 even on a CPU machine (taken
# from the nvidia-cuda-runtime-cu12 wheel) and libb64.so.0d (Debian package libb64-0d).
# PYTHON selects the interpreter whose packages are searched (default: the repo's .venv).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3

# The wheel installs the binary as a data script; its RECORD says where, relative to site-packages.
PA=$("$PY" - <<'PYEOF'
import importlib.metadata as md, os, shutil, sys, sysconfig
cands = []
try:
    dist = md.distribution("tritonclient")
    cands += [str(dist.locate_file(f)) for f in (dist.files or []) if os.path.basename(str(f)) == "perf_analyzer"]
except md.PackageNotFoundError:
    pass
cands += [os.path.join(sysconfig.get_path("scripts"), "perf_analyzer"), shutil.which("perf_analyzer") or ""]
for c in cands:
    if c and os.access(c, os.X_OK):
        print(os.path.realpath(c)); break
else:
    sys.exit("perf_analyzer not found: install tritonclient[grpc]==2.51.0 (newer wheels do not ship it)")
PYEOF
)
CUDART=$("$PY" - <<'PYEOF'
import importlib.util, os, sys
spec = importlib.util.find_spec("nvidia.cuda_runtime")
if spec is None or not spec.submodule_search_locations:
    sys.exit("libcudart not found: pip install nvidia-cuda-runtime-cu12")
print(os.path.join(list(spec.submodule_search_locations)[0], "lib"))
PYEOF
)
if ! ldconfig -p 2>/dev/null | grep -q libb64.so.0d; then
  echo "perf_analyzer.sh: libb64.so.0d missing (apt-get install libb64-0d)" >&2
fi
export LD_LIBRARY_PATH="$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$PA" "$@"
