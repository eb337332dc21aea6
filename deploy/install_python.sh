#!/usr/bin/env bash
# Installs CPython VERSION (with its shared libpython, which the Triton python-backend stub links) on
# the NGC images' Ubuntu 22.04 and makes a virtualenv at VENV with it. Used by deploy/Dockerfile and
# deploy/Dockerfile.loadgen at build time (root, network).
#
#   deploy/install_python.sh VERSION VENV [deadsnakes|ubuntu]
#
# Why not the image's own python3: it is 3.10, and triton 3.9.0, transformers 5.24.0, locust 2.47.0
# and hypothesis 6.170.17 (requirements.txt) publish nothing for 3.10. Where from:
#   deadsnakes (default): the deadsnakes PPA's current 3.11.x build for Ubuntu 22.04;
#   ubuntu: Ubuntu 22.04's own python3.11 (universe, jammy-updates), which is 3.11.0~rc1, a release candidate.
set -euo pipefail
VERSION=${1:?usage: install_python.sh VERSION VENV [deadsnakes|ubuntu]}
VENV=${2:?usage: install_python.sh VERSION VENV [deadsnakes|ubuntu]}
SOURCE=${3:-deadsnakes}
export DEBIAN_FRONTEND=noninteractive

apt-get update -q
case $SOURCE in
  deadsnakes)
    apt-get install -y -q --no-install-recommends software-properties-common gpg-agent
    add-apt-repository -y ppa:deadsnakes/ppa
    apt-get update -q ;;
  ubuntu) ;;
  *) echo "install_python.sh: unknown source '$SOURCE' (deadsnakes or ubuntu)" >&2; exit 2 ;;
esac
apt-get install -y -q --no-install-recommends "python$VERSION" "python$VERSION-venv" "libpython$VERSION"
rm -rf /var/lib/apt/lists/*

"python$VERSION" -m venv "$VENV"
"$VENV/bin/python" - "$VERSION" <<'EOF'
import os, sys, sysconfig
want = tuple(int(x) for x in sys.argv[1].split("."))
assert sys.version_info[:2] == want, f"venv runs {sys.version}, wanted {sys.argv[1]}"
lib = os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME"))
assert os.path.exists(lib), f"{lib} is missing: the python-backend stub links the shared libpython"
print(f"[install_python] {sys.executable}: Python {sys.version.split()[0]}, {lib}")
EOF
