"""Llama-family forward pass over the paged KV cache (SmolLM2, Llama 2/3, Mistral; Qwen2 with qkv bias)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import AttentionOps, attention_ops
from .forward_batch import ForwardBatch
from .kv_cache import KVCache
from .model_config import ModelConfig
from .rotary import RotaryEmbedding
from .weights import LlamaWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In fp32 like the reference implementation, so bf16 activations keep their accuracy.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: LlamaWeights, *, device: torch.device, dtype: torch.dtype,
                 ops: AttentionOps | None = None):
        self.config = config
        self.weights = weights
        self.rope = RotaryEmbedding(config, device, dtype)
        self.ops = ops or attention_ops(device)
        self.scale = config.head_dim ** -0.5
        c = config
        self._q, self._kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Computes and stores the KV of batch's tokens; returns fp32 logits [S, V] for logits_indices."""
        c, w = self.config, self.weights
        h = F.embedding(batch.input_ids, w.embed)
        for layer, lw in enumerate(w.layers):
            residual = h
            x = rms_norm(h, lw.input_norm, c.rms_norm_eps)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)
            q, k, v = qkv.split([self._q, self._kv, self._kv], dim=-1)
            q = q.view(-1, c.num_heads, c.head_dim)
            k = k.view(-1, c.num_kv_heads, c.head_dim)
            v = v.view(-1, c.num_kv_heads, c.head_dim)
            q, k = self.rope(batch.positions, q, k)
            self.ops.write_kv(k, v, kv.k[layer], kv.v[layer], batch.slot_mapping)
            attn = self._attention(q, kv.k[layer], kv.v[layer], batch)
            h = residual + F.linear(attn.reshape(-1, self._q), lw.o_proj)
            residual = h
            x = rms_norm(h, lw.post_norm, c.rms_norm_eps)
            gate, up = F.linear(x, lw.gate_up).chunk(2, dim=-1)
            h = residual + F.linear(F.silu(gate) * up, lw.down)
        h = h.index_select(0, batch.logits_indices)
        h = rms_norm(h, w.final_norm, c.rms_norm_eps)
        return F.linear(h, w.lm_head).float()

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        if b.decode_only:
            return self.ops.paged_decode_attention(q, k_cache, v_cache, b.page_table, b.context_lens, self.scale,
                                                   max_context=b.max_context)
        return self.ops.paged_prefill_attention(q, k_cache, v_cache, b.page_table, b.query_start_loc, b.context_lens,
                                                self.scale, max_query_len=b.max_query_len)
