"""The KV page pool's memory: one K and one V tensor per layer, allocated once for the process."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .model_config import ModelConfig

log = logging.getLogger("kvshare.runtime")


@dataclass(frozen=True)
class KVCache:
    k: tuple[torch.Tensor, ...]   # per layer [num_pages, page_size, Hkv, D]
    v: tuple[torch.Tensor, ...]
    page_size: int

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @classmethod
    def allocate(cls, config: ModelConfig, *, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        k = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers))
        v = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers))
        cache = cls(k, v, page_size)
        log.info("KV page pool: %d pages x %d tokens, %.1f MiB on %s", num_pages, page_size, cache.nbytes / 2**20, device)
        return cache


def pages_for_memory(config: ModelConfig, *, page_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    per_page = 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * torch.finfo(dtype).bits // 8
    return max(1, budget_bytes // per_page)
