"""Linear layers over weights kept in GGUF's 32-weight blocks (Q4_1, Q8_0), for the CPU.

``BlockWeight`` holds a weight [N, K] packed for ``cpu/block_gemm.cpp`` (its header draws the
layout); ``block_linear(x, w)`` is ``x @ dequantize(w).T`` computed by that kernel, which widens the
blocks in registers instead of reading fp32 weights: a decode step reads 0.625 (Q4_1) or 1.0625
(Q8_0) bytes per weight instead of 4. ``dequantize`` is the torch reference, and gives the fp32
weights gguf-py (and so transformers) loads from the same file, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_native

BLOCK = 32       # weights per block
LANES = 16       # columns per packed panel
FORMATS = {"q4_1": 0, "q8_0": 1}


@dataclass(frozen=True)
class BlockWeight:
    """A [out_features, in_features] weight in blocks, packed in panels of 16 output columns."""
    format: str                  # "q4_1" or "q8_0"
    qs: torch.Tensor             # uint8 [N/16, K/2 (q4_1) or K (q8_0), 16]
    d: torch.Tensor              # int16, fp16 bits [N/16, K/32, 16]
    m: torch.Tensor | None       # q4_1's mins, like d; None for q8_0

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0] * LANES, self.d.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)


def packable(n: int, k: int) -> bool:
    """Whether an [n, k] weight fits the kernel's layout (whole panels, whole blocks)."""
    return n > 0 and n % LANES == 0 and k > 0 and k % BLOCK == 0


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[N, X] -> [N/16, X, 16]: column n of panel p is row 16 p + n."""
    n = t.shape[0]
    return t.reshape(n // LANES, LANES, *t.shape[1:]).transpose(1, 2).contiguous()


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> BlockWeight:
    """From unpacked codes q [N, K] (0..15) and fp16 scales and mins [N, K/32]: w = d q + m."""
    n, k = q.shape
    if not packable(n, k) or d.shape != (n, k // BLOCK) or m.shape != d.shape:
        raise ValueError(f"q4_1 weight [{n}, {k}] with scales {tuple(d.shape)}: needs N % 16 == 0, K % 32 == 0")
    q = q.to(torch.uint8)
    pairs = q[:, 0::2] | (q[:, 1::2] << 4)          # k even in the low nibble, k + 1 in the high
    return BlockWeight("q4_1", _panels(pairs), _panels(d.to(torch.float16).view(torch.int16)),
                       _panels(m.to(torch.float16).view(torch.int16)))


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> BlockWeight:
    """From codes q [N, K] (int8) and fp16 scales [N, K/32]: w = d q."""
    n, k = q.shape
    if not packable(n, k) or d.shape != (n, k // BLOCK):
        raise ValueError(f"q8_0 weight [{n}, {k}] with scales {tuple(d.shape)}: needs N % 16 == 0, K % 32 == 0")
    return BlockWeight("q8_0", _panels(q.to(torch.int8).view(torch.uint8)), _panels(d.to(torch.float16).view(torch.int16)),
                       None)


def unpack(w: BlockWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The codes [N, K], scales and mins [N, K/32] (fp16) that ``w`` was packed from."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(-1, t.shape[1])

    d = rows(w.d).view(torch.float16)
    if w.format == "q4_1":
        pairs = rows(w.qs)
        q = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).reshape(pairs.shape[0], -1)
        return q, d, rows(w.m).view(torch.float16)
    return rows(w.qs).view(torch.int8), d, None


def dequantize(w: BlockWeight) -> torch.Tensor:
    """The fp32 weight [N, K]: d * q (+ m), a multiply then an add, in fp32 as gguf-py computes it."""
    q, d, m = unpack(w)
    scaled = d.float().repeat_interleave(BLOCK, dim=1) * q.float()
    return scaled + m.float().repeat_interleave(BLOCK, dim=1) if m is not None else scaled


def cat_rows(*weights: BlockWeight) -> BlockWeight:
    """The weights stacked along out_features (a fused QKV or gate/up projection)."""
    formats = {w.format for w in weights}
    if len(formats) != 1 or len({w.shape[1] for w in weights}) != 1:
        raise ValueError(f"cat_rows needs one format and one in_features: {[(w.format, w.shape) for w in weights]}")
    m = torch.cat([w.m for w in weights]) if weights[0].m is not None else None
    return BlockWeight(weights[0].format, torch.cat([w.qs for w in weights]), torch.cat([w.d for w in weights]), m)


def block_linear(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(w).T (+ bias), fp32 on the CPU through the native kernel."""
    if not cpu_native.available():
        raise RuntimeError("kvshare's CPU block kernel does not run here (python -m kvshare_kernels.cpu_native says why)")
    lead = x.shape[:-1]
    y = torch.ops.kvshare_cpu.block_linear(x.reshape(-1, x.shape[-1]).contiguous(), w.qs, w.d, w.m, FORMATS[w.format])
    if bias is not None:
        y += bias
    return y.view(*lead, y.shape[-1])


def available() -> bool:
    """Whether block_linear runs on this machine (cpu_native: the library built, AVX-512F)."""
    return cpu_native.available()
