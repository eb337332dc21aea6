"""The KV page pool's memory: one K and one V tensor per layer, allocated once for the process.

``kv_cache_dtype`` picks the page layout (docs/operate/tune.md): ``auto`` stores K/V in the
model's dtype; ``fp8_e4m3`` in fp8 with a per-tensor scale (1.0); ``int8`` in int8 with a float32
scale per (token, KV head) in per-layer scale tensors [num_pages, page_size, Hkv] beside K and V.
Every per-page tensor (K, V and scales, GPU pool and host tier alike) has the page dimension
first, and ``page_tensors()`` / ``host_page_tensors()`` list them in the same order, so a tier
copies pages as opaque tensors without knowing the layout.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from kvshare_kernels import kv_quant

from .model_config import ModelConfig

log = logging.getLogger("kvshare.runtime")

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
FP8_SCALE = 1.0       # fp8's per-tensor K and V scale (docs/operate/tune.md: why no calibration)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool tensors' dtype for a kv_cache_dtype setting."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return kv_quant.FP8
    if kv_cache_dtype == "int8":
        return torch.int8
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got '{kv_cache_dtype}'")


@dataclass(frozen=True)
class KVCache:
    k: tuple[torch.Tensor, ...]   # per layer [num_pages, page_size, Hkv, D]
    v: tuple[torch.Tensor, ...]
    page_size: int
    # the host tier's slots, per layer [host_pages, page_size, Hkv, D] on the CPU (pinned with CUDA)
    host_k: tuple[torch.Tensor, ...] = ()
    host_v: tuple[torch.Tensor, ...] = ()
    # int8 only: per layer float32 [num_pages, page_size, Hkv] (and the host tier's [host_pages, ...])
    k_scale: tuple[torch.Tensor, ...] = ()
    v_scale: tuple[torch.Tensor, ...] = ()
    host_k_scale: tuple[torch.Tensor, ...] = ()
    host_v_scale: tuple[torch.Tensor, ...] = ()
    fp8_scale: float = FP8_SCALE

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
    def dtype(self) -> torch.dtype:
        """The pages' storage dtype (the model's, torch.float8_e4m3fn or torch.int8)."""
        return self.k[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.page_tensors())

    @property
    def bytes_per_token(self) -> int:
        """Pool bytes one token takes over all layers: K, V and their scales (what decode reads per token)."""
        return self.nbytes // (self.num_pages * self.page_size)

    def page_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every per-page tensor of the GPU pool, page dimension first: K and V per layer, then int8's scales."""
        return (*self.k, *self.v, *self.k_scale, *self.v_scale)

    def host_page_tensors(self) -> tuple[torch.Tensor, ...]:
        """The host tier's counterparts of page_tensors(), in the same order (empty without a tier)."""
        return (*self.host_k, *self.host_v, *self.host_k_scale, *self.host_v_scale)

    def layer_scales(self, layer: int) -> dict:
        """The kernels' k_scale/v_scale arguments for ``layer`` (none for a 16-bit pool)."""
        if self.k_scale:
            return dict(k_scale=self.k_scale[layer], v_scale=self.v_scale[layer])
        if self.dtype == kv_quant.FP8:
            return dict(k_scale=self.fp8_scale, v_scale=self.fp8_scale)
        return {}

    @classmethod
    def allocate(cls, config: ModelConfig, *, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, host_pages: int = 0) -> "KVCache":
        """``dtype``: the pages' storage dtype (kv_storage_dtype): int8 adds the scale tensors."""
        layers = range(config.num_layers)
        pin = device.type == "cuda"     # page copies to and from pinned memory run asynchronously

        def tensors(pages: int, trailing: tuple[int, ...], dt: torch.dtype, host: bool) -> tuple[torch.Tensor, ...]:
            if not pages:
                return ()
            if host:
                return tuple(torch.zeros((pages, page_size, *trailing), dtype=dt, pin_memory=pin) for _ in layers)
            return tuple(torch.zeros((pages, page_size, *trailing), dtype=dt, device=device) for _ in layers)

        kv_shape = (config.num_kv_heads, config.head_dim)
        scaled = dtype == torch.int8
        s_shape = (config.num_kv_heads,)
        cache = cls(tensors(num_pages, kv_shape, dtype, False), tensors(num_pages, kv_shape, dtype, False), page_size,
                    tensors(host_pages, kv_shape, dtype, True), tensors(host_pages, kv_shape, dtype, True),
                    tensors(num_pages if scaled else 0, s_shape, torch.float32, False),
                    tensors(num_pages if scaled else 0, s_shape, torch.float32, False),
                    tensors(host_pages if scaled else 0, s_shape, torch.float32, True),
                    tensors(host_pages if scaled else 0, s_shape, torch.float32, True))
        log.info("KV page pool: %d pages x %d tokens, %s, %.1f MiB on %s", num_pages, page_size, dtype,
                 cache.nbytes / 2**20, device)
        if host_pages:
            host_bytes = sum(t.numel() * t.element_size() for t in cache.host_page_tensors())
            log.info("KV host tier: %d pages, %.1f MiB of %shost memory", host_pages, host_bytes / 2**20,
                     "pinned " if device.type == "cuda" else "")
        return cache


def page_bytes(config: ModelConfig, *, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page over all layers, K and V, int8's scales included (``dtype``: the storage dtype)."""
    return 2 * config.num_layers * page_size * config.num_kv_heads * kv_quant.bytes_per_token_head(config.head_dim, dtype)


def pages_for_memory(config: ModelConfig, *, page_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """Pages that fit ``budget_bytes`` in the storage ``dtype``: an 8-bit pool gets about twice a 16-bit one."""
    return max(1, budget_bytes // page_bytes(config, page_size=page_size, dtype=dtype))
