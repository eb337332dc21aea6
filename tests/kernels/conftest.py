"""Kernel tests run in one of two modes, chosen before Triton is imported:

* CPU (CI): TRITON_INTERPRET=1, the Triton kernels run on CPU tensors under the interpreter, at
  small shapes; tests marked ``gpu`` skip.
* GPU (a machine with CUDA, TRITON_INTERPRET unset or 0): the same small tests run compiled on
  "cuda" tensors, and the ``gpu`` tests run at full shapes.

Set TRITON_INTERPRET yourself to force a mode.
"""

import importlib
import os
import sys


def _cuda_available() -> bool:
    try:
        import torch   # importing torch does not import triton
        return torch.cuda.is_available()
    except Exception:
        return False


if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if _cuda_available() else "1"

import pytest  # noqa: E402
import triton  # noqa: E402,F401  (after TRITON_INTERPRET is set)

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

# Kernels are decorated (compiled or interpreted) when their module is imported: if something
# imported them before this file set the mode, decorate them again.
for _name in ("kv_tiles", "kv_write", "decode_attention", "prefill_attention", "page_copy", "cascade_decode", "fused_silu", "kernels"):
    _mod = sys.modules.get(f"kvshare_kernels.{_name}")
    if _mod is not None:
        importlib.reload(_mod)


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE
