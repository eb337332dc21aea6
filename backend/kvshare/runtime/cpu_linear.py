"""The CPU's linear layer: oneDNN's matmul instead of MKL's sgemm behind F.linear.

`F.linear(x, w)` on the CPU is MKL's sgemm of x @ w.T, which repacks its B operand, the whole
weight, on every call: with a decode step's few rows that costs more than the multiply. oneDNN's
inner product (torch's `mkldnn::_linear_pointwise`, the op that torch.compile's CPU backend
emits) reads the weight as it lies. Measured on the 2-core AVX2 CI machine with SmolLM2-135M's
shapes (`python -m perf.engine.cpu_decode_step`): at 12 rows the tied lm_head [49152, 576] takes
2.2x less time and gate_up [3072, 576] 1.8x less; at a prefill's 1536 rows about 1.1x less.
The values are F.linear's up to float32 rounding. fp32 only (the CPU default); other dtypes, or a
torch without oneDNN, keep F.linear. The CPU model's default; KVSHARE_CPU_LINEAR=0 keeps F.linear
(runtime/llama.py).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from kvshare_kernels.block_linear import BlockWeight, block_linear

Linear = Callable[..., torch.Tensor]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) through oneDNN, for float32 tensors on the CPU.

    On the AVX2 CI machine a row's result does not depend on how many rows come with it nor where
    it sits among them (checked from 1 to 2048 rows with SmolLM2's weight shapes), so a prompt's
    tail computed alone after a prefix-cache hit, or a sequence decoded beside others, gets the
    very bits it would get in any other batch; not on every CPU (rows_batch_invariant). oneDNN takes another path for a single
    row, with other roundings: that row goes in twice. (MKL's sgemm behind F.linear is not
    invariant either: below 12 rows most counts round differently.)"""
    if x.dim() == 2 and x.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), weight, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def cpu_linear(dtype: torch.dtype) -> Linear:
    """The linear layer for a CPU model in `dtype`: onednn_linear where it applies, else F.linear."""
    available = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return onednn_linear if available and dtype == torch.float32 else F.linear


def with_blocks(dense: Linear) -> Linear:
    """A linear layer that runs BlockWeight weights through the block kernel and tensors through ``dense``.

    The block kernel's rows are batch-invariant on every CPU it runs on (cpu/block_gemm.cpp)."""
    def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, BlockWeight):
            return block_linear(x, weight, bias)
        return dense(x, weight, bias)
    return linear


@functools.cache
def rows_batch_invariant() -> bool:
    """Whether onednn_linear gives a row the same bits whatever rows come with it, on this CPU.

    True on the AVX2 EPYC of CI; false on the AVX-512 Xeon host of the H200 machine (2026-12-02),
    where oneDNN takes other kernels for some row counts (8 rows at the end of 2,048 rounded
    differently). Probed once, with SmolLM2's gate_up shape and the slices that differed there
    (about 0.2 s on two cores): the tests that rely on the property ask it first."""
    if cpu_linear(torch.float32) is not onednn_linear:
        return False
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(3072, 576, generator=g) * 0.05, torch.randn(2048, 576, generator=g)
    full = onednn_linear(x, w)
    slices = ((0, 512), (1000, 1537), (2040, 2048), (2047, 2048), (3, 40), (10, 11))
    return all(torch.equal(onednn_linear(x[a:b].clone(), w), full[a:b]) for a, b in slices)
