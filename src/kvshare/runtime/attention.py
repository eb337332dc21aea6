"""Picks the paged-attention implementation: Triton kernels on CUDA, the torch reference elsewhere."""
from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch


class AttentionOps(Protocol):
    write_kv: object
    paged_decode_attention: object
    paged_prefill_attention: object
    copy_pages: object


def attention_ops(device: torch.device) -> ModuleType:
    if device.type == "cuda":
        import kvshare_kernels

        return kvshare_kernels
    from kvshare_kernels import reference

    return reference
