"""Rotary position embedding with a cos/sin table computed once for every position."""
from __future__ import annotations

import torch

from .model_config import ModelConfig


def _hf_rope_config(config: ModelConfig, params: dict):
    """A transformers config carrying just what its rope initialisers read."""
    from transformers import LlamaConfig

    params = {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}
    return LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
                       head_dim=config.head_dim, max_position_embeddings=config.max_position,
                       rope_parameters={"rope_theta": config.rope_theta, **params})


def _inv_freq(config: ModelConfig, params: dict) -> tuple[torch.Tensor, float]:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        # Scaled variants (llama3, yarn, ...): reuse transformers' initialisers for exact parity.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](_hf_rope_config(config, params), "cpu")
        return inv.float(), float(scaling)
    d = config.head_dim
    theta = float(params.get("rope_theta", config.rope_theta))
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    return inv, 1.0


def _longrope_long_inv_freq(config: ModelConfig, params: dict) -> tuple[torch.Tensor, int]:
    """longrope's long-factor frequencies and the position from which they apply."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    start = int(params["original_max_position_embeddings"])
    inv, _ = ROPE_INIT_FUNCTIONS["longrope"](_hf_rope_config(config, params), "cpu", seq_len=start + 1)
    return inv.float(), start


class RotaryEmbedding:
    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 parameters: tuple[tuple[str, object], ...] | None = None):
        """parameters: the rope to tabulate (default config.rope_parameters; Gemma 3's sliding layers
        pass their own)."""
        params = dict(config.rope_parameters if parameters is None else parameters)
        inv, scaling = _inv_freq(config, params)
        pos = torch.arange(config.max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        if params.get("rope_type") == "longrope":
            # Positions from original_max_position_embeddings on rotate with the long factors: what
            # HF's per-forward switch gives each token while decoding (and vLLM gives per position).
            long_inv, start = _longrope_long_inv_freq(config, params)
            freqs[start:] = pos[start:, None] * long_inv[None, :]
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
