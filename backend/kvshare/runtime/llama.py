"""The forward pass over the paged KV cache for every family of model_family.py (Llama, Mistral, Qwen2/3,
Gemma 2/3, Phi-3): one Llama loop, each family's differences read once from its FamilySpec in __init__."""
from __future__ import annotations

import os
from types import ModuleType
from typing import Callable

import kvshare_kernels
import torch
import torch.nn.functional as F
from kvshare_kernels import cpu_decode

from .cpu_attention import row_invariant_prefill
from .cpu_linear import cpu_linear, with_blocks
from .forward_batch import ForwardBatch
from .kv_cache import KVCache
from .model_config import ModelConfig
from .model_family import FAMILIES
from .rotary import RotaryEmbedding
from .weights import LlamaWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In fp32 like the reference implementation, so bf16 activations keep their accuracy.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's order: the fp32 weight (1 + w, folded at load) multiplies before the cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


def _gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: LlamaWeights, *, device: torch.device, dtype: torch.dtype,
                 ops: ModuleType | None = None, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.config = config
        self.weights = weights
        # Tensor parallelism (runtime/tensor_parallel.py): config and weights are this rank's shard, and
        # the two row-parallel outputs of each block (o_proj, down) are summed over the ranks.
        self.all_reduce = all_reduce
        self.rope = RotaryEmbedding(config, device, dtype)
        self.ops = ops or kvshare_kernels.ops(device)   # Triton on CUDA, torch reference elsewhere
        self.scale = config.attn_scale or config.head_dim ** -0.5
        c = config
        self._q, self._kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        spec = FAMILIES[c.family]
        self.family = spec
        # Per layer, fixed for the model: the attention ops' window/softcap keywords ({} for a plain
        # layer, so a Llama's calls stay what they were) and its rope table (Gemma 3's sliding layers
        # have their own).
        windows = c.layer_window
        self._attn_kw = tuple(({"window": wnd} if wnd else {}) | ({"softcap": c.attn_softcap} if c.attn_softcap else {})
                              for wnd in windows)
        local_rope = RotaryEmbedding(config, device, dtype, c.sliding_rope_parameters) if c.sliding_rope_parameters else None
        self._layer_rope = tuple(local_rope if (local_rope is not None and wnd) else self.rope for wnd in windows)
        self._embed_scale = (torch.tensor(c.embed_scale, dtype=dtype, device=device) if c.embed_scale else None)
        self._norm_fn = gemma_rms_norm if spec.norm == "gemma" else rms_norm
        self._act_mul = _gelu_tanh_mul if c.activation == "gelu_pytorch_tanh" else None
        # On CUDA the norms (with their residual adds), the rotary with the KV write, and silu(gate)*up run as fused Triton
        # kernels (kvshare_kernels.fused_*: one launch each instead of 2-12); the CPU keeps the torch ops
        # below, HF transformers' own. KVSHARE_FUSED_KERNELS=0 turns the fusion off. A family whose
        # math a kernel does not express takes the torch ops for that part: Gemma's norms (fp32
        # weight before the cast), gelu, and q/k norms (the rotary then runs on the normed heads).
        self.fused = torch.device(device).type == "cuda" and os.environ.get("KVSHARE_FUSED_KERNELS", "1") != "0"
        self._fused_norm_on = self.fused and spec.norm == "llama"
        self._fused_rotary_on = self.fused and not spec.qk_norm
        self._fused_act_on = self.fused and self._act_mul is None
        cpu = torch.device(device).type == "cpu"
        # The CPU's linear layers run through oneDNN (cpu_linear.py: a decode step's large GEMMs in
        # about half the time of F.linear's sgemm, a row's bits independent of the rows beside it);
        # KVSHARE_CPU_LINEAR=0 keeps F.linear.
        onednn = cpu and os.environ.get("KVSHARE_CPU_LINEAR", "1") != "0"
        # Weights kept in a GGUF's blocks (weights.load_model(cpu_blocks=True)) take the block kernel.
        self._linear = with_blocks(cpu_linear(dtype) if onednn else F.linear)
        # The CPU's prefill attention gives a chunk of 1-3 rows other bits than a longer one
        # (cpu_attention.py): padded, a prompt's tail computed after a prefix-cache hit gets its
        # first run's bits.
        prefill = self.ops.paged_prefill_attention
        self._prefill_attention = row_invariant_prefill(prefill) if cpu else prefill
        # The CPU's decode attention reads the pages in place through kvshare's native op (fp32 pools;
        # the reference where it does not apply): the reference gathers each layer's K and V first.
        self._decode_attention = cpu_decode.paged_decode_attention if cpu else self.ops.paged_decode_attention
        # On CUDA a step's prefill reads each chunk's own keys from the projection (rotated in place)
        # instead of back from the pool: bulk copies at any page size (prefill_attention.py, k_new).
        # KVSHARE_PREFILL_NEW_KV=0 reads them from the pool as before.
        self._new_kv_on = torch.device(device).type == "cuda" and os.environ.get("KVSHARE_PREFILL_NEW_KV", "1") != "0"
        # With them, on Hopper at pages smaller than the 128-key tile, a prefix tile arrives by one bulk
        # copy per page (prefill_pages_tma.py, Gluon, ping-pong consumers): 0.89-0.99x of FA3 against
        # 0.73-0.98x for the Triton launch (H100, docs/develop/kernels.md). KVSHARE_PREFILL_PAGE_COPIES=0 keeps
        # the Triton launch.
        self._page_copies = self._new_kv_on and os.environ.get("KVSHARE_PREFILL_PAGE_COPIES", "1") != "0"
        # Windowed or soft-capped layers take neither the page-copy prefill nor cascade decode (neither
        # implements them): per layer, whether it may.
        self._plain_layer = tuple(not kw for kw in self._attn_kw)
        self._dtype = dtype
        self._new_kv_by_cache_dtype: dict[torch.dtype, bool] = {}
        if self.fused:
            from kvshare_kernels.fused_norm import rms_norm as fused_rms_norm
            from kvshare_kernels.fused_rotary import rotary_write_kv
            from kvshare_kernels.fused_silu import silu_and_mul

            self._fused_rms_norm, self._fused_rotary_write_kv = fused_rms_norm, rotary_write_kv
            self._fused_silu_mul = silu_and_mul

    def prefill_reads_new_kv(self, cache_dtype: torch.dtype) -> bool:
        """Whether steps with a prompt chunk hand the prefill kernel the step's own K/V (the engine
        builds its work lists for the launch this implies: prefill_attention.default_launch).
        Asked every step: answered once per pool dtype."""
        known = self._new_kv_by_cache_dtype.get(cache_dtype)
        if known is None:
            known = False
            if self._new_kv_on:
                from kvshare_kernels.prefill_attention import new_kv_applies

                known = new_kv_applies(cache_dtype, self._dtype, self.config.head_dim, self.rope.cos.device)
            self._new_kv_by_cache_dtype[cache_dtype] = known
        return known

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Computes and stores the KV of batch's tokens; returns fp32 logits [S, V] for logits_indices."""
        c, w = self.config, self.weights
        new_kv = not batch.decode_only and batch.cascade is None and self.prefill_reads_new_kv(kv.dtype)
        h = F.embedding(batch.input_ids, w.embed)
        if self._embed_scale is not None:
            h = h * self._embed_scale
        residual = None
        for layer, lw in enumerate(w.layers):
            x, residual = self._add_norm(h, residual, lw.input_norm)
            qkv = self._linear(x, lw.qkv, lw.qkv_bias)
            q, k, v = qkv.split([self._q, self._kv, self._kv], dim=-1)
            q = q.view(-1, c.num_heads, c.head_dim)
            k = k.view(-1, c.num_kv_heads, c.head_dim)
            v = v.view(-1, c.num_kv_heads, c.head_dim)
            if lw.q_norm is not None:       # per head, before rotary (Qwen3, Gemma 3)
                q, k = self._norm_fn(q, lw.q_norm, c.rms_norm_eps), self._norm_fn(k, lw.k_norm, c.rms_norm_eps)
            scales = kv.layer_scales(layer)      # {} for 16-bit pages
            q, k = self._rotary_write_kv(batch, q, k, v, kv.k[layer], kv.v[layer], scales, new_kv,
                                         self._layer_rope[layer])
            attn = self._attention(q, kv.k[layer], kv.v[layer], batch, scales, (k, v) if new_kv else None, layer)
            h = self._linear(attn.reshape(-1, self._q), lw.o_proj)
            if self.all_reduce is not None:
                h = self.all_reduce(h)
            if lw.o_bias is not None:       # after the sum over ranks: added once
                h = h + lw.o_bias
            if lw.attn_out_norm is not None:     # Gemma's sandwich norms
                h = self._norm(h, lw.attn_out_norm)
            x, residual = self._add_norm(h, residual, lw.post_norm)
            h = self._linear(self._silu_mul(self._linear(x, lw.gate_up)), lw.down)
            if self.all_reduce is not None:
                h = self.all_reduce(h)
            if lw.mlp_out_norm is not None:
                h = self._norm(h, lw.mlp_out_norm)
        h = (residual + h).index_select(0, batch.logits_indices)
        h = self._norm(h, w.final_norm)
        logits = self._linear(h, w.lm_head)
        if c.final_softcap:      # in the activation dtype, as HF does
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits.float()

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._act_mul is not None:
            return self._act_mul(gate_up)
        if self._fused_act_on:   # one kernel, same rounding as the two torch ones
            return self._fused_silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._fused_norm_on:
            return self._fused_rms_norm(x, weight, self.config.rms_norm_eps)
        return self._norm_fn(x, weight, self.config.rms_norm_eps)

    def _add_norm(self, h: torch.Tensor, residual: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + h), residual + h); no residual yet (layer 0): h is the residual stream.

        The fused kernel adds into ``residual`` in place (a tensor this forward owns); the torch
        path allocates the sum, as the reference implementation does.
        """
        if residual is None:
            return self._norm(h, weight), h
        if self._fused_norm_on:
            return self._fused_rms_norm(h, weight, self.config.rms_norm_eps, residual=residual), residual
        residual = residual + h
        return self._norm_fn(residual, weight, self.config.rms_norm_eps), residual

    def _rotary_write_kv(self, b: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, scales: dict,
                         keep_k: bool, rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k at their positions and stores the new K/V in their slots (quantized for an
        8-bit pool); returns (q, k), k rotated where keep_k (the fused kernel's k stays unrotated
        otherwise: the pool holds the rotated values)."""
        if self._fused_rotary_on:   # one kernel: q rotated in place, rotated k and v straight into the pool
            q = self._fused_rotary_write_kv(q, k, v, rope.cos, rope.sin, b.positions,
                                            k_cache, v_cache, b.slot_mapping, k_in_place=keep_k, **scales)
            return q, k
        q, k = rope(b.positions, q, k)
        self.ops.write_kv(k, v, k_cache, v_cache, b.slot_mapping, **scales)
        return q, k

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, b: ForwardBatch,
                   scales: dict, new_kv: tuple[torch.Tensor, torch.Tensor] | None, layer: int) -> torch.Tensor:
        plain = self._plain_layer[layer]
        if b.cascade is not None and plain:
            return self.ops.cascade_decode_attention(q, k_cache, v_cache, b.page_table, b.context_lens, b.cascade,
                                                     self.scale, max_context=b.max_context, **scales)
        kw = self._attn_kw[layer]
        if b.decode_only or b.cascade is not None:    # a cascade step's windowed/capped layers read their own rows
            return self._decode_attention(q, k_cache, v_cache, b.page_table, b.context_lens, self.scale,
                                          max_context=b.max_context, **scales, **kw)
        if new_kv is not None:
            scales = {**scales, "k_new": new_kv[0], "v_new": new_kv[1]}
            if self._page_copies and plain:
                scales["page_copies"] = True
        return self._prefill_attention(q, k_cache, v_cache, b.page_table, b.query_start_loc, b.context_lens,
                                      self.scale, max_query_len=b.max_query_len, tiles=b.prefill_tiles, **scales, **kw)
