"""The environment the GPU machine needs, in one place.

Nothing of ours is pip-installed there: the device runs a copy of the working tree at its root with
the image's Python 3.12, torch, Triton and transformers. Every stage of `python -m perf.gpu` gets
`stage_env()`: the three packages' source folders and the repo root on PYTHONPATH (`kvshare`,
`kvshare_kernels`, `kvshare_client`, `perf`), unbuffered output, the Hugging Face hub offline.

    python3 perf/gpu/env.py                            # `export ...` lines, for a shell script:
    eval "$(python3 perf/gpu/env.py)"                  #   what perf/server/fullstack.sh does
    python3 perf/gpu/env.py server-venv BUNDLE ENV_DIR # the real server's virtualenv (below)

`server-venv` builds the Python environment the Triton 2.51 server needs there, from the bundle that
perf/server/make_fullstack_bundle.sh makes on the CPU machine (carried as .carry/fullstack), by
the recipe of environment.md ("The GPU machine"):
  - a virtualenv made with --without-pip from this interpreter (the image's python3, 3.12), by hand
    when its venv module fails (or with --manual-venv);
  - the bundle's cp312 packages (numpy 1.26.4, python-rapidjson, protobuf<5, tritonclient 2.51 with
    perf_analyzer) unpacked into its site-packages, so they come first;
  - the Triton server (pytriton/tritonserver + nvidia_pytriton.libs) beside them, with the
    python-backend stub of this Python in backends/python/;
  - .pth files: hide sklearn/scipy (built for numpy 2 in the image), then the image's own
    site-packages AFTER ours (torch, triton, transformers...), then this checkout's packages;
  - perf_analyzer's libraries in ENV_DIR/palib: libcudart.so.12 from the nvidia-cuda-runtime-cu12
    wheel and libb64.so.0d from the Debian package, for LD_LIBRARY_PATH.
It writes ENV_DIR/activate.sh (PY, PA, PA_LD) and rebuilds ENV_DIR from scratch every time.
This file imports nothing of the repo, so any python3 can run it.
"""
from __future__ import annotations

import argparse
import glob
import io
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
# Source folders of the installable packages (kvshare, kvshare_kernels, kvshare_client), then the
# repo root (perf). On the CPU machine they are installed editable, and these entries change nothing.
PACKAGE_DIRS = ("backend", "kernels", "client")
FIXED = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def python_path(root: Path = ROOT) -> list[str]:
    return [str(root / d) for d in PACKAGE_DIRS] + [str(root)]


def stage_env(base: Optional[Mapping[str, str]] = None, root: Path = ROOT,
              extra_path: Sequence[str] = ()) -> dict[str, str]:
    """`base` (default os.environ) with the repo's packages first on PYTHONPATH and FIXED set."""
    env = dict(os.environ if base is None else base)
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    new = [*extra_path, *python_path(root)]
    env["PYTHONPATH"] = os.pathsep.join(new + [p for p in old if p not in new])
    env.update(FIXED)
    return env


def exports(root: Path = ROOT) -> str:
    env = stage_env({"PYTHONPATH": os.environ.get("PYTHONPATH", "")}, root)
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


# ------------------------------------------------------------------ the real server's virtualenv

def _log(msg: str) -> None:
    print(f"[env {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _image_sites() -> list[str]:
    override = os.environ.get("FULLSTACK_IMAGE_SITE")
    if override:
        return [p for p in override.split(":") if p]
    return [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]


def _make_venv(venv: Path, pyver: str, manual: bool) -> None:
    if not manual:
        if subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)]).returncode == 0:
            return
        _log("python -m venv failed: writing the virtualenv by hand")
    shutil.rmtree(venv, ignore_errors=True)
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    (venv / "bin").mkdir(parents=True)
    (venv / "lib" / f"python{pyver}" / "site-packages").mkdir(parents=True)
    os.symlink(base, venv / "bin" / "python")
    os.symlink("python", venv / "bin" / "python3")
    os.symlink("python", venv / "bin" / f"python{pyver}")
    import platform
    (venv / "pyvenv.cfg").write_text(f"home = {os.path.dirname(base)}\ninclude-system-site-packages = false\n"
                                     f"version = {platform.python_version()}\n")


def _deb_data(deb: Path, dest: Path) -> None:
    """`dpkg -x` without dpkg: an .deb is an ar archive whose data.tar.* holds the files."""
    if shutil.which("dpkg"):
        subprocess.run(["dpkg", "-x", str(deb), str(dest)], check=True)
        return
    data = deb.read_bytes()
    pos = 8                                         # "!<arch>\n", then 60-byte headers
    while pos < len(data):
        name, size = data[pos:pos + 16].decode().strip().rstrip("/"), int(data[pos + 48:pos + 58])
        body = data[pos + 60:pos + 60 + size]
        if name.startswith("data.tar"):
            tarfile.open(fileobj=io.BytesIO(body)).extractall(dest)
        pos += 60 + size + (size & 1)


def _missing_libs(binary: Path, ld_path: str) -> str:
    try:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True,
                             env={**os.environ, "LD_LIBRARY_PATH": ld_path}).stdout
    except OSError:
        return ""
    return " ".join(line.split()[0] for line in out.splitlines() if "not found" in line)


def server_venv(bundle: Path, envdir: Path, manual_venv: bool = False, root: Path = ROOT) -> Path:
    """Builds the virtualenv (see the module's docstring); returns ENV_DIR/activate.sh."""
    bundle = bundle.resolve()
    manifest = bundle / "MANIFEST.txt"
    if not manifest.is_file():
        raise SystemExit(f"no MANIFEST.txt in {bundle}: run perf/server/make_fullstack_bundle.sh here and "
                         "carry .carry/fullstack")
    pyver = "%d.%d" % sys.version_info[:2]
    want = next((line[7:] for line in manifest.read_text().splitlines() if line.startswith("python=")), "")
    if pyver != want:
        raise SystemExit(f"the bundle is for Python {want} but {sys.executable} is {pyver}")
    sites = _image_sites()
    _log(f"base {sys.executable} {sys.version.split()[0]}; image site dirs: {':'.join(sites)}")

    shutil.rmtree(envdir, ignore_errors=True)
    (envdir / "palib").mkdir(parents=True)
    venv = envdir / "venv"
    _make_venv(venv, pyver, manual_venv or os.environ.get("FULLSTACK_MANUAL_VENV") == "1")
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    _log(f"venv {py}, site-packages {site}")
    for archive in ("site.tar.xz", "tritonserver.tar.xz"):
        subprocess.run(["tar", "-xJf", str(bundle / archive), "-C", str(site)], check=True)
    ts = site / "pytriton" / "tritonserver"
    shutil.copy2(ts / "python_backend_stubs" / pyver / "triton_python_backend_stub",
                 ts / "backends" / "python" / "triton_python_backend_stub")
    _log(f"Triton server unpacked, stub for Python {pyver} in backends/python/")

    # .pth files run in name order, after the venv's site-packages is on sys.path: ours come first.
    (site / "zz_fullstack_1_hide.pth").write_text(
        "import sys; [sys.modules.setdefault(m, None) for m in ('sklearn', 'scipy')]\n")
    (site / "zz_fullstack_2_image.pth").write_text("".join(f"import site; site.addsitedir('{d}')\n" for d in sites))
    (site / "zz_fullstack_3_repo.pth").write_text("".join(p + "\n" for p in python_path(root)))

    # perf_analyzer's libraries (only for perf_analyzer: the server bundles its own libcudart).
    debs = sorted(bundle.glob("libb64-0d_*.deb"))
    if not debs:
        raise SystemExit(f"no libb64-0d_*.deb in {bundle}")
    _deb_data(debs[0], envdir / "libb64")
    lib = next(p for p in sorted((envdir / "libb64").rglob("libb64.so.0d*")))
    shutil.copyfile(lib, envdir / "palib" / "libb64.so.0d")                 # follows the symlink
    wheel = glob.glob(str(bundle / "nvidia_cuda_runtime_cu12-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith("/lib/libcudart.so.12"))
        (envdir / "palib" / "libcudart.so.12").write_bytes(z.read(name))
    pa = site / "bin" / "perf_analyzer"
    pa.chmod(0o755)
    activate = envdir / "activate.sh"
    activate.write_text(f"PY={py}\nPA={pa}\nPA_LD={envdir / 'palib'}\n")

    libdir = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')"],
                            capture_output=True, text=True).stdout.strip()
    for what, binary, ld in (("the stub", ts / "backends" / "python" / "triton_python_backend_stub", libdir),
                             ("perf_analyzer", pa, str(envdir / "palib"))):
        missing = _missing_libs(binary, ld)
        if missing:
            _log(f"WARNING: {what} misses libraries: {missing}")
    _log(f"ready: {activate}")
    return activate


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    sv = sub.add_parser("server-venv", help="build the real server's virtualenv from the carried bundle")
    sv.add_argument("bundle", type=Path)
    sv.add_argument("envdir", type=Path)
    sv.add_argument("--manual-venv", action="store_true", help="write the virtualenv by hand (no venv module)")
    a = ap.parse_args(argv)
    if a.cmd == "server-venv":
        server_venv(a.bundle, a.envdir, a.manual_venv)
    else:
        print(exports())
    return 0


if __name__ == "__main__":
    sys.exit(main())
