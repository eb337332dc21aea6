"""Model weights in the layout kvshare's forward wants (fused QKV and gate/up projections), for every
family of model_family.py: Phi-3's checkpoint is fused already, Gemma's (1 + w) norms are folded.

Sources: a transformers model (loaded from a GGUF file or an HF safetensors directory) or random
"dummy" weights for a named shape (benchmarks: speed does not depend on weight values).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from kvshare_kernels import block_linear

from .model_config import NAMED_CONFIGS, ModelConfig
from .model_family import FAMILIES, UnsupportedModel
from .tokenizer import default_model_source, generation_eos_ids, hf_location, load_tokenizer

log = logging.getLogger("kvshare.runtime")


# A linear layer's weight [out, in]: a dense tensor, or (CPU) the GGUF's blocks (kvshare_kernels.block_linear).
Linear = torch.Tensor | block_linear.BlockWeight


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor      # [H]
    qkv: Linear                   # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None
    o_proj: Linear                # [H, Hq D]
    post_norm: torch.Tensor       # [H]
    gate_up: Linear               # [2 I, H]
    down: Linear                  # [H, I]
    # Families beyond Llama (model_family.py); None where the family has none.
    o_bias: torch.Tensor | None = None         # [H]
    q_norm: torch.Tensor | None = None         # [D] per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None         # [D]
    attn_out_norm: torch.Tensor | None = None  # [H] on the attention's output before its residual add (Gemma)
    mlp_out_norm: torch.Tensor | None = None   # [H] on the MLP's output before its residual add (Gemma)


@dataclass(frozen=True)
class LlamaWeights:
    embed: torch.Tensor           # [V, H]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor      # [H]
    lm_head: Linear               # [V, H] (the embedding itself when tied)


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: LlamaWeights
    tokenizer: object | None      # a transformers tokenizer; None for dummy weights
    source: str


def _from_hf_model(hf, dtype: torch.dtype, device: torch.device,
                   extra_eos: tuple[int, ...] = ()) -> tuple[ModelConfig, LlamaWeights]:
    config = ModelConfig.from_hf(hf.config, extra_eos=extra_eos)
    spec = FAMILIES[config.family]
    sd = {k: v for k, v in hf.state_dict().items()}
    # Gemma 3's multimodal checkpoint keeps its language model one level down.
    base = "model.language_model." if "model.language_model.embed_tokens.weight" in sd else "model."

    def t(name: str) -> torch.Tensor:
        return sd[name].to(device=device, dtype=dtype).contiguous()

    def norm(name: str) -> torch.Tensor:
        if spec.norm == "gemma":
            # HF computes normalized * (1 + w) in fp32 and casts after: kept in fp32 so bf16 matches.
            return (1.0 + sd[name].float()).to(device).contiguous()
        return t(name)

    layers = []
    for i in range(config.num_layers):
        p = f"{base}layers.{i}."
        a = p + "self_attn."
        if spec.fused_projections:
            qkv, gate_up = t(a + "qkv_proj.weight"), t(p + "mlp.gate_up_proj.weight")
        else:
            qkv = torch.cat([t(a + "q_proj.weight"), t(a + "k_proj.weight"), t(a + "v_proj.weight")]).contiguous()
            gate_up = torch.cat([t(p + "mlp.gate_proj.weight"), t(p + "mlp.up_proj.weight")]).contiguous()
        bias = None
        if config.qkv_bias:
            bias = torch.cat([t(a + f"{n}_proj.bias") for n in "qkv"])
        sandwich = spec.sandwich_norms
        layers.append(LayerWeights(
            input_norm=norm(p + "input_layernorm.weight"),
            qkv=qkv,
            qkv_bias=bias,
            o_proj=t(a + "o_proj.weight"),
            # the norm in front of the MLP: Gemma's pre_feedforward_layernorm (its post_attention_layernorm
            # is the attention's output norm)
            post_norm=norm(p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")),
            gate_up=gate_up,
            down=t(p + "mlp.down_proj.weight"),
            o_bias=t(a + "o_proj.bias") if config.o_bias else None,
            q_norm=norm(a + "q_norm.weight") if spec.qk_norm else None,
            k_norm=norm(a + "k_norm.weight") if spec.qk_norm else None,
            attn_out_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
            mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
        ))
    embed = t(base + "embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings or "lm_head.weight" not in sd else t("lm_head.weight")
    return config, LlamaWeights(embed=embed, layers=tuple(layers), final_norm=norm(base + "norm.weight"), lm_head=lm_head)


# The GPU kernels' largest head: at 256 (Gemma 2/3) the bf16 prefill tile overflows shared memory
# and fp32 logprobs miss HF's by 0.1 (perf/engine/check_family_parity.py, H100, 2026-12-08).
MAX_GPU_HEAD_DIM = 128


def check_supported(where: str, kwargs: dict, device: torch.device = torch.device("cpu")) -> None:
    """Refuse an unsupported family or config key (model_family.py), or a head the device's kernels
    do not run, before loading any weight."""
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(where, **kwargs))
    if device.type == "cuda" and config.head_dim > MAX_GPU_HEAD_DIM:
        raise UnsupportedModel(f"{config.family}: head_dim {config.head_dim} is not supported on the GPU yet (the "
                               f"kernels take head_dim <= {MAX_GPU_HEAD_DIM}); it runs on the CPU (device cpu)")


def load_model(source: str | None = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int = 0, cpu_blocks: bool = False) -> LoadedModel:
    """Load weights and tokenizer.

    ``source`` is a path to a ``.gguf`` file, an HF model directory, or ``dummy:<name>`` with a
    name from NAMED_CONFIGS. None means the embedded default (SmolLM2-135M-Instruct).
    ``cpu_blocks``: a GGUF's quantized linear layers stay in its blocks (float32 on the CPU, where
    the kernel runs; else, or if the blocks do not widen to transformers' weights, fp32 as always).
    """
    device = torch.device(device)
    source = source or default_model_source()
    if source.startswith("dummy:"):
        name = source.split(":", 1)[1]
        if name not in NAMED_CONFIGS:
            raise ValueError(f"unknown dummy model '{name}'; known: {sorted(NAMED_CONFIGS)}")
        config = NAMED_CONFIGS[name]
        return LoadedModel(config, random_weights(config, dtype=dtype, device=device, seed=seed), None, source)

    from transformers import AutoModelForCausalLM

    where, kwargs = hf_location(source)
    log.info("loading %s (dtype %s, device %s)", source, dtype, device)
    check_supported(where, kwargs, device)
    tokenizer = load_tokenizer(source)
    hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
    config, weights = _from_hf_model(hf, dtype, device, generation_eos_ids(where, kwargs))
    del hf
    if cpu_blocks and source.endswith(".gguf") and device.type == "cpu" and dtype == torch.float32 \
            and config.family == "llama":
        weights = _with_blocks(source, config, weights)
    return LoadedModel(config, weights, tokenizer, source)


def _with_blocks(source: str, config: ModelConfig, weights: LlamaWeights) -> LlamaWeights:
    """weights with the GGUF's blocks in place of the fp32 linear layers, where they apply."""
    from .gguf_blocks import UnsupportedBlocks, check_against, load_blocks

    if not block_linear.available():
        return weights
    try:
        layers, head = load_blocks(source, config)
    except UnsupportedBlocks as exc:
        log.info("linear layers stay fp32: %s", exc)
        return weights
    # Cheap insurance that the loader reads the file as transformers does (row order, nibble order).
    first = weights.layers[0]
    if not all(check_against(layers[0][n], getattr(first, n)) for n in layers[0]) or \
            not check_against(head, weights.lm_head):
        log.warning("the GGUF's blocks do not widen to transformers' fp32 weights; linear layers stay fp32")
        return weights
    fp32 = sum(getattr(lw, n).numel() * 4 for lw in weights.layers for n in layers[0]) + weights.lm_head.numel() * 4
    kept = sum(b.nbytes for lw in layers for b in lw.values()) + head.nbytes
    log.info("linear layers in the GGUF's blocks (%s): %.0f MB instead of %.0f MB of fp32 weights",
             ", ".join(sorted({b.format for lw in layers for b in lw.values()} | {head.format})), kept / 1e6, fp32 / 1e6)
    new_layers = tuple(dataclasses.replace(lw, **blocks) for lw, blocks in zip(weights.layers, layers))
    return dataclasses.replace(weights, layers=new_layers, lm_head=head)


def random_weights(config: ModelConfig, *, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaWeights:
    """Random weights scaled so activations stay finite through many layers (values are irrelevant)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * d

    def rnd(*shape: int, fan_in: int) -> torch.Tensor:
        w = torch.empty(*shape, device=device, dtype=dtype)
        return w.normal_(0.0, fan_in ** -0.5, generator=gen)

    ones = torch.ones(h, device=device, dtype=dtype)
    layers = tuple(
        LayerWeights(
            input_norm=ones, qkv=rnd(qkv_rows, h, fan_in=h),
            qkv_bias=torch.zeros(qkv_rows, device=device, dtype=dtype) if config.qkv_bias else None,
            o_proj=rnd(h, config.num_heads * d, fan_in=config.num_heads * d), post_norm=ones,
            gate_up=rnd(2 * i, h, fan_in=h), down=rnd(h, i, fan_in=i),
        )
        for _ in range(config.num_layers)
    )
    embed = rnd(config.vocab_size, h, fan_in=1)
    lm_head = embed if config.tie_word_embeddings else rnd(config.vocab_size, h, fan_in=h)
    return LlamaWeights(embed=embed, layers=layers, final_norm=ones, lm_head=lm_head)
