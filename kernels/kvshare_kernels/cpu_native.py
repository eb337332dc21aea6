"""Builds and loads kvshare's native CPU kernels (``cpu/*.cpp``, torch ops under ``torch.ops.kvshare_cpu``).

The library is compiled once per source, torch version and compiler into ``cpu/_build/`` (about 15 s
on two cores; ``scripts/setup.sh`` does it, ``python -m kvshare_kernels.cpu_native`` by hand). A
process that finds no library builds it where a C++ compiler exists; without one, or on a CPU
without AVX-512, ``available()`` is False and the callers keep their fp32 paths.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("kvshare.kernels")

# the block GEMM (linear layers on GGUF blocks) and the paged decode attention, one library
SOURCES = tuple(Path(__file__).parent / "cpu" / name for name in ("block_gemm.cpp", "paged_decode.cpp"))
HEADERS = (Path(__file__).parent / "cpu" / "check.h",)
FLAGS = ("-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-w")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def library_path() -> Path:
    """Where the library for this source, torch and flag set lies (its name is their digest)."""
    key = hashlib.sha1()
    # torch's own directory too: the library's rpath names it.
    for part in (*(src.read_bytes() for src in (*SOURCES, *HEADERS)), torch.__version__.encode(), torch.__file__.encode(), " ".join(FLAGS).encode(),
                 str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()):
        key.update(part)
    return SOURCES[0].parent / "_build" / f"kvshare_cpu-{key.hexdigest()[:12]}.so"


def build() -> Path:
    """Compiles the library if it is not there yet; returns its path. Raises RuntimeError on failure."""
    target = library_path()
    if target.exists():
        return target
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) to build kvshare's CPU kernels; install g++ or set CXX")
    from torch.utils.cpp_extension import include_paths, library_paths

    target.parent.mkdir(parents=True, exist_ok=True)
    lib = library_paths()[0]
    # Written beside the target and renamed: a concurrent loader never sees half a library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-I{p}" for p in include_paths()), *map(str, SOURCES), "-o", tmp,
           f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    log.info("building kvshare's CPU kernels: %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {', '.join(src.name for src in SOURCES)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    os.replace(tmp, target)
    return target


@functools.cache
def available() -> bool:
    """Whether torch.ops.kvshare_cpu runs here: the library built and loaded, and the CPU has AVX-512F."""
    try:
        path = build()
        torch.ops.load_library(str(path))
    except (RuntimeError, OSError) as exc:
        log.warning("kvshare's CPU block kernels are unavailable (%s); linear layers keep fp32 weights",
                    str(exc).splitlines()[0])
        return False
    if not torch.ops.kvshare_cpu.supported():
        log.info("this CPU lacks AVX-512F: linear layers keep fp32 weights")
        return False
    return True


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build()
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    torch.ops.load_library(str(path))
    print(f"{path} (this CPU {'runs' if torch.ops.kvshare_cpu.supported() else 'cannot run'} it: AVX-512F)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
