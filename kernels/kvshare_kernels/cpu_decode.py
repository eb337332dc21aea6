"""The CPU's paged decode attention: kvshare's native op (cpu/paged_decode.cpp) where it applies,
the torch reference elsewhere.

The native op reads K and V in place through the page table (the reference gathers every
sequence's pages into dense tensors first, twice a layer), and gives each output the same bits
whatever the thread count or the other sequences of the step. It takes fp32 pools (the CPU
default), head dims that are multiples of 16, and a CPU with AVX-512F; anything else (8-bit
pages, bf16, another CPU) takes the reference, with the same signature."""
from __future__ import annotations

import torch

from . import cpu_native, reference


def native_applies(q: torch.Tensor, k_cache: torch.Tensor, scales: dict) -> bool:
    return (not scales and q.dtype == torch.float32 and k_cache.dtype == torch.float32 and q.device.type == "cpu"
            and q.shape[-1] % 16 == 0 and cpu_native.available())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                           max_context: int | None = None, window: int = 0, softcap: float = 0.0,
                           debug: bool | None = None, **scales) -> torch.Tensor:
    """reference.paged_decode_attention's contract; the native op where native_applies()."""
    if window or softcap or not native_applies(q, k_cache, scales):
        # The native op reads every page from 0 and has no cap: windowed and capped layers take the
        # reference, which skips the released pages before a window.
        return reference.paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale, out,
                                                max_context=max_context, window=window, softcap=softcap,
                                                debug=debug, **scales)
    o = torch.ops.kvshare_cpu.paged_decode_attention(q.contiguous(), k_cache, v_cache, page_table.int().contiguous(),
                                                     context_lens.int().contiguous(), float(scale))
    if out is None:
        return o
    out.copy_(o)
    return out
