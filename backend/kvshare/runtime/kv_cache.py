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
    # the host tier's slots, per layer [host_pages, page_size, Hkv, D] on the CPU (pinned with CUDA)
    host_k: tuple[torch.Tensor, ...] = ()
    host_v: tuple[torch.Tensor, ...] = ()

    def page_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every per-layer tensor indexed by page first ([num_pages, ...]): what a page is. Tier copies
        move pages as these opaque tensors, never K and V by name (a KV dtype with per-page scales
        appends its scale tensors here and in host_page_tensors, in the same order)."""
        return (*self.k, *self.v)

    def host_page_tensors(self) -> tuple[torch.Tensor, ...]:
        """The host tier's counterpart of page_tensors(): [host_pages, ...] each, same order and shapes."""
        return (*self.host_k, *self.host_v)

    @property
    def host_page_bytes(self) -> int:
        """Bytes of one page over all its tensors (a host slot, a disk file's body)."""
        return sum(t[0].numel() * t.element_size() for t in self.host_page_tensors())

    @property
    def host_pages(self) -> int:
        return self.host_k[0].shape[0] if self.host_k else 0

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @classmethod
    def allocate(cls, config: ModelConfig, *, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, host_pages: int = 0) -> "KVCache":
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        k = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers))
        v = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers))
        host_k: tuple[torch.Tensor, ...] = ()
        host_v: tuple[torch.Tensor, ...] = ()
        if host_pages:
            pin = device.type == "cuda"     # page copies to and from pinned memory run asynchronously
            host_shape = (host_pages,) + shape[1:]
            host_k = tuple(torch.zeros(host_shape, dtype=dtype, pin_memory=pin) for _ in range(config.num_layers))
            host_v = tuple(torch.zeros(host_shape, dtype=dtype, pin_memory=pin) for _ in range(config.num_layers))
        cache = cls(k, v, page_size, host_k, host_v)
        log.info("KV page pool: %d pages x %d tokens, %.1f MiB on %s", num_pages, page_size, cache.nbytes / 2**20, device)
        if host_pages:
            host_bytes = sum(t.numel() * t.element_size() for t in (*host_k, *host_v))
            log.info("KV host tier: %d pages, %.1f MiB of %shost memory", host_pages, host_bytes / 2**20,
                     "pinned " if device.type == "cuda" else "")
        return cache


def pages_for_memory(config: ModelConfig, *, page_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    per_page = 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * torch.finfo(dtype).bits // 8
    return max(1, budget_bytes // per_page)
