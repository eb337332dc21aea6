"""Model families as data: what each HF ``model_type``'s forward does differently from Llama's.

The forward (llama.py) is one loop; a family is the set of flags it reads, plus the config keys
each flag takes its value from. ``read_family`` turns an HF config (as transformers normalised it:
``layer_types`` and ``rope_parameters`` already derived from the legacy keys) into those values and
refuses, by name, anything that would change the forward and is not handled here: a model never
runs as Llama by accident.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


class UnsupportedModel(ValueError):
    """A model_type or config key kvshare's forward does not implement."""


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    # "llama": weight * normalized.to(dtype); "gemma": (normalized * (1 + weight)) in fp32, then cast
    norm: str = "llama"
    qk_norm: bool = False             # RMSNorm over each head's q and k after projection, before rotary
    sandwich_norms: bool = False      # a norm on the attention's and the MLP's outputs before each residual add
    embed_scale: bool = False         # embeddings * sqrt(hidden_size), the scale rounded to the activation dtype
    activation_key: str = "hidden_act"    # the config key naming the MLP's activation
    # where per-layer windows come from: "none", "all" (config.sliding_window on every layer),
    # "layer_types" (config.sliding_window on the layers typed "sliding_attention")
    windows: str = "none"
    softcaps: bool = False            # attn_logit_softcapping / final_logit_softcapping
    query_pre_attn_scalar: bool = False   # attention scale query_pre_attn_scalar ** -0.5
    rope_per_layer_type: bool = False     # rope_parameters keyed by layer type (Gemma 3's local/global)
    fused_projections: bool = False   # qkv_proj and gate_up_proj in the checkpoint (Phi-3)
    qkv_bias: str = "config"          # "always" (Qwen2) or the config's attention_bias
    o_bias: bool = True               # o_proj carries attention_bias too (Llama, Qwen3, Gemma); not Qwen2

    @property
    def config_keys(self) -> tuple[str, ...]:
        """The config keys beyond Llama's that this family's forward reads (documentation, errors)."""
        keys = [self.activation_key]
        if self.windows != "none":
            keys.append("sliding_window")
        if self.windows == "layer_types":
            keys.append("layer_types")
        if self.softcaps:
            keys += ["attn_logit_softcapping", "final_logit_softcapping"]
        if self.query_pre_attn_scalar:
            keys.append("query_pre_attn_scalar")
        if self.qkv_bias == "config":
            keys.append("attention_bias")
        return tuple(keys)


FAMILIES: dict[str, FamilySpec] = {spec.model_type: spec for spec in (
    FamilySpec("llama"),
    FamilySpec("mistral", windows="all"),
    FamilySpec("qwen2", windows="layer_types", qkv_bias="always", o_bias=False),
    FamilySpec("qwen3", windows="layer_types", qk_norm=True),
    FamilySpec("gemma2", norm="gemma", sandwich_norms=True, embed_scale=True, activation_key="hidden_activation",
               windows="layer_types", softcaps=True, query_pre_attn_scalar=True),
    FamilySpec("gemma3_text", norm="gemma", qk_norm=True, sandwich_norms=True, embed_scale=True,
               activation_key="hidden_activation", windows="layer_types", softcaps=True,
               query_pre_attn_scalar=True, rope_per_layer_type=True),
    FamilySpec("phi3", windows="all", fused_projections=True),
)}

# Families whose block is a mixture of experts: named so the error says why, not just "unknown".
MOE_MODEL_TYPES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "phimoe", "deepseek_v2", "deepseek_v3",
                             "dbrx", "olmoe", "granitemoe", "jamba", "gpt_oss", "llama4", "llama4_text"})
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

# The activations the MLP implements: silu(gate) * up, or gelu with the tanh approximation.
ACTIVATIONS = frozenset({"silu", "gelu_pytorch_tanh"})
# Rope variants with a position -> cos/sin table (rotary.py). dynamic is exact up to
# max_position_embeddings, the limit kvshare serves anyway. longrope (Phi-3's 128k checkpoints) is
# refused: HF picks its short or long factors per forward call from the call's longest position, so
# the keys a prompt gets depend on how it was chunked; kvshare has not settled which rule to serve,
# and a per-position switch disagreed with HF on a tiny Phi-3 past the switch.
ROPE_TYPES = frozenset({"default", "linear", "llama3", "dynamic", "yarn"})


@dataclass(frozen=True)
class FamilyValues:
    """What the forward needs beyond Llama's shape, read from one config."""
    family: str
    activation: str
    layer_windows: tuple[int, ...]          # () when no layer slides
    attn_softcap: float
    final_softcap: float
    attn_scale: float                       # 0: head_dim ** -0.5
    embed_scale: float                      # 0: none
    rope: tuple[tuple[str, object], ...]    # the full-attention layers' rope parameters
    sliding_rope: tuple[tuple[str, object], ...]   # the sliding layers' when they differ; () = same
    qkv_bias: bool
    o_bias: bool


def family_of(hf) -> FamilySpec:
    """The FamilySpec for an HF config, or UnsupportedModel naming why not."""
    model_type = getattr(hf, "model_type", None)
    if model_type in MOE_MODEL_TYPES:
        raise UnsupportedModel(f"model_type '{model_type}' is a mixture-of-experts model: MoE blocks are not "
                               f"supported (supported: {sorted(FAMILIES)})")
    spec = FAMILIES.get(model_type)
    if spec is None:
        raise UnsupportedModel(f"model_type '{model_type}' is not supported (supported: {sorted(FAMILIES)}); "
                               "refusing to run it as Llama")
    return spec


def read_family(hf) -> FamilyValues:
    spec = family_of(hf)
    _refuse_unhandled(hf, spec)
    layers = hf.num_hidden_layers
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    windows = _layer_windows(hf, spec, layers)
    rope, sliding_rope = _rope(hf, spec)
    attn_scale = float(hf.query_pre_attn_scalar) ** -0.5 if spec.query_pre_attn_scalar else 0.0
    if attn_scale == head_dim ** -0.5:
        attn_scale = 0.0      # the default scale: keep the Llama path's constant
    bias = bool(getattr(hf, "attention_bias", False))
    return FamilyValues(
        family=spec.model_type,
        activation=getattr(hf, spec.activation_key, None) or "silu",
        layer_windows=windows,
        attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0) if spec.softcaps else 0.0,
        final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0) if spec.softcaps else 0.0,
        attn_scale=attn_scale,
        embed_scale=math.sqrt(hf.hidden_size) if spec.embed_scale else 0.0,
        rope=rope, sliding_rope=sliding_rope,
        qkv_bias=spec.qkv_bias == "always" or bias,
        o_bias=spec.o_bias and bias,
    )


def _refuse_unhandled(hf, spec: FamilySpec) -> None:
    name = spec.model_type
    for key in MOE_CONFIG_KEYS:
        if getattr(hf, key, None):
            raise UnsupportedModel(f"{name}: config key '{key}' = {getattr(hf, key)} makes it a mixture-of-experts "
                                   "model: MoE blocks are not supported")
    if _quantized(hf):
        raise UnsupportedModel(f"{name}: config key 'quantization_config' (quantized weights) is not supported yet")
    act = getattr(hf, spec.activation_key, None) or "silu"
    if act not in ACTIVATIONS:
        raise UnsupportedModel(f"{name}: {spec.activation_key} '{act}' is not supported (supported: {sorted(ACTIVATIONS)})")
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedModel(f"{name}: config key 'mlp_bias' (biases on the MLP's projections) is not supported")
    if getattr(hf, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"{name}: config key 'use_bidirectional_attention' is not supported (causal only)")
    if (getattr(hf, "pretraining_tp", 1) or 1) != 1:
        raise UnsupportedModel(f"{name}: config key 'pretraining_tp' = {hf.pretraining_tp} is not supported")
    if not spec.softcaps:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(hf, key, None):
                raise UnsupportedModel(f"{name}: config key '{key}' is not read by this family's forward")


def _layer_windows(hf, spec: FamilySpec, layers: int) -> tuple[int, ...]:
    window = getattr(hf, "sliding_window", None)
    if spec.windows == "none":
        if window:
            raise UnsupportedModel(f"{spec.model_type}: config key 'sliding_window' is not read by this family's forward")
        return ()
    if spec.windows == "all":
        return (int(window),) * layers if window else ()
    types = list(getattr(hf, "layer_types", None) or ["full_attention"] * layers)
    if len(types) < layers:
        raise UnsupportedModel(f"{spec.model_type}: layer_types has {len(types)} entries for {layers} layers")
    unknown = sorted(set(types[:layers]) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModel(f"{spec.model_type}: layer_types {unknown} are not supported "
                               "(full_attention, sliding_attention)")
    if "sliding_attention" not in types[:layers]:
        return ()
    if not window:
        # HF would run such layers with sliding_window None (full); a config this inconsistent
        # (e.g. Qwen's use_sliding_window off with explicit sliding layer_types) is refused.
        raise UnsupportedModel(f"{spec.model_type}: layer_types names sliding_attention layers but sliding_window "
                               f"is {window!r} (use_sliding_window={getattr(hf, 'use_sliding_window', None)!r})")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types[:layers])


def _rope_items(params: dict, model_type: str) -> tuple[tuple[str, object], ...]:
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(f"{model_type}: rope_type '{rope_type}' is not supported (supported: {sorted(ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise UnsupportedModel(f"{model_type}: partial_rotary_factor {partial} is not supported (rotary over the whole head only)")
    params.pop("type", None)
    params["rope_type"] = rope_type
    items = []
    for key, value in params.items():
        if isinstance(value, (list, tuple)):     # longrope's short/long factors
            items.append((key, tuple(float(x) for x in value)))
        elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
            items.append((key, value))
    return tuple(sorted(items))


def _rope(hf, spec: FamilySpec) -> tuple[tuple, tuple]:
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    if getattr(hf, "partial_rotary_factor", None) not in (None, 1, 1.0):
        raise UnsupportedModel(f"{spec.model_type}: partial_rotary_factor {hf.partial_rotary_factor} is not supported")
    if spec.rope_per_layer_type:
        full = dict(params.get("full_attention") or {})
        sliding = dict(params.get("sliding_attention") or {})
        full_items, sliding_items = _rope_items(full, spec.model_type), _rope_items(sliding, spec.model_type)
        return full_items, (() if sliding_items == full_items else sliding_items)
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel(f"{spec.model_type}: rope_parameters per layer type are not supported for this family")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    return _rope_items(params, spec.model_type), ()


def _quantized(hf) -> bool:
    """Whether the checkpoint's weights stay quantized: transformers marks a GGUF it loaded with a
    gguf quantization_config although it has widened every tensor already (kvshare's CPU path reads
    the file's own blocks separately), so only other methods (fp8, awq, gptq, ...) count."""
    q = getattr(hf, "quantization_config", None)
    if not q:
        return False
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method)).lower() != "gguf"
