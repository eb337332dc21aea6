"""Rotary position embedding with a cos/sin table computed once for every position."""
from __future__ import annotations

import torch

from .model_config import ModelConfig


def _inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    params = dict(config.rope_parameters)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        # Scaled variants (llama3, yarn, ...): reuse transformers' initialisers for exact parity.
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
                         head_dim=config.head_dim, max_position_embeddings=config.max_position,
                         rope_parameters={"rope_theta": config.rope_theta, **params})
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
        return inv.float(), float(scaling)
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    return inv, 1.0


class RotaryEmbedding:
    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        inv, scaling = _inv_freq(config)
        pos = torch.arange(config.max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scaling).to(device=device, dtype=dtype)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated at their absolute positions [T]."""
        cos = self.cos.index_select(0, positions)[:, None, :]     # index_select: int32 or int64 positions
        sin = self.sin.index_select(0, positions)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
