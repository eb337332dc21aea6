"""Tiny random models of every supported family (runtime/model_family.py), saved as HF directories.

Each is built with transformers' own config class and ``AutoModelForCausalLM.from_config`` under a
fixed seed, its norm weights perturbed (HF initialises Gemma's to 0 and the others' to 1, which would
hide a wrong ``(1 + w)``), and saved with SmolLM2's tokenizer (the loader wants one; prompts are
token ids, all below the tiny vocabulary). Windows are small (8-12 tokens) so that prompts of a few
pages cross them. Meant for the families' parity checks against HF transformers (CPU fp32, CUDA bf16).
"""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Gemma scales its embeddings by sqrt(hidden_size): at the others' 0.1 its tiny models saturate and
# repeat one token whatever the prompt, which would hide a wrong forward.
GEMMA = {**COMMON, "initializer_range": 0.04}
WINDOW = 8


def tiny_configs(head_dim: int = 16, window: int = WINDOW) -> dict[str, object]:
    """name -> a transformers config; each name's family (and the variant it exercises) in the name.
    head_dim > 16 widens every model to 4 heads of it (the GPU kernels' real head sizes), window
    sets the sliding window (Phi-3's is window + 4)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)

    common = {**COMMON, "hidden_size": 4 * head_dim, "intermediate_size": 6 * head_dim, "head_dim": head_dim,
              "max_position_embeddings": max(128, 16 * window)}
    gemma = {**common, "initializer_range": GEMMA["initializer_range"]}
    return {
        # Llama 3's rope scaling and attention_bias (biases on q/k/v and o_proj)
        "llama": LlamaConfig(**common, num_hidden_layers=2, attention_bias=True,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32}),
        "mistral": MistralConfig(**common, num_hidden_layers=2, sliding_window=window),
        # use_sliding_window from layer 1 on (max_window_layers 1): one full layer, two sliding
        "qwen2": Qwen2Config(**common, num_hidden_layers=3, use_sliding_window=True, sliding_window=window,
                             max_window_layers=1),
        # q/k norms and yarn rope
        "qwen3": Qwen3Config(**common, num_hidden_layers=2,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                              "original_max_position_embeddings": 64}),
        # sliding, full, sliding; both soft-caps; query_pre_attn_scalar unlike head_dim
        "gemma2": Gemma2Config(**gemma, num_hidden_layers=3, sliding_window=window, query_pre_attn_scalar=24,
                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        # local rope (rope_local_base_freq) on sliding layers, linear scaling on the full ones; q/k norms
        "gemma3_text": Gemma3TextConfig(**gemma, num_hidden_layers=4, sliding_window=window, sliding_window_pattern=2,
                                        query_pre_attn_scalar=12, rope_local_base_freq=100.0,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=10000.0),
        # fused qkv_proj / gate_up_proj and a window on every layer (Phi-3-mini-4k's shape; longrope is refused)
        "phi3": Phi3Config(**{**common, "num_key_value_heads": 4}, num_hidden_layers=2, sliding_window=window + 4,
                           tie_word_embeddings=False),
    }


def build(name: str, directory: Path, *, seed: int = 0, tokenizer=None, head_dim: int = 16,
          window: int = WINDOW) -> Path:
    """Save tiny model ``name`` (and ``tokenizer``, when given) into directory/name; returns the folder."""
    from transformers import AutoModelForCausalLM

    config = tiny_configs(head_dim, window)[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    out = Path(directory) / name
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def prompt_ids(n: int, length: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """HF generate's greedy continuation, never stopping early (the tiny models' EOS is a random token)."""
    model.generation_config.eos_token_id = None
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                                          device=device),
                             max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()
