"""The shape of a model of one of the supported families (model_family.py), independent of where its
weights come from. The defaults are Llama's: a config built by hand (NAMED_CONFIGS) is a Llama."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    # Anything transformers' rope initialisers need beyond theta (llama3 scaling, yarn...).
    rope_parameters: tuple[tuple[str, object], ...] = field(default=())
    # Sliding-window size per layer (0 = full causal attention); () = every layer full.
    layer_windows: tuple[int, ...] = ()
    # The family's forward differences (model_family.FAMILIES[family]: norms, q/k norm, ...) and the
    # values they read; the defaults leave the Llama forward as it was.
    family: str = "llama"
    activation: str = "silu"             # the MLP's: silu or gelu_pytorch_tanh
    attn_softcap: float = 0.0            # scores become C tanh(s / C) (Gemma 2); 0 = none
    final_softcap: float = 0.0           # logits become C tanh(l / C); 0 = none
    attn_scale: float = 0.0              # 0: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    embed_scale: float = 0.0             # embeddings times this in the activation dtype (Gemma); 0 = none
    o_bias: bool = False                 # o_proj has a bias (attention_bias on Llama, Qwen3, Gemma)
    # The rope of sliding-window layers where it differs from rope_parameters (Gemma 3's local rope,
    # rope_theta included); () = every layer uses rope_parameters.
    sliding_rope_parameters: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def kv_release_window(self) -> int:
        """W when every layer slides the same window W > 0: pages wholly before the window can go back
        to the pool while a request runs. 0 when any layer attends fully (its pages stay needed)."""
        if len(self.layer_windows) != self.num_layers or not self.layer_windows:
            return 0
        first = self.layer_windows[0]
        return first if first > 0 and all(w == first for w in self.layer_windows) else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token over all layers at 2 bytes per element (fp16/bf16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @property
    def layer_window(self) -> tuple[int, ...]:
        """Every layer's window (0 = full), also for a config with layer_windows ()."""
        return self.layer_windows or (0,) * self.num_layers

    @classmethod
    def from_hf(cls, hf, *, extra_eos: tuple[int, ...] = ()) -> "ModelConfig":
        """From a transformers config; UnsupportedModel (model_family.py) for a family or a config key
        the forward does not implement. extra_eos: more stop ids (generation_config.json's)."""
        from .model_family import read_family

        if getattr(hf, "model_type", None) == "gemma3" and hasattr(hf, "text_config"):
            hf = hf.text_config          # Gemma 3's multimodal checkpoint: its language model
        fam = read_family(hf)
        heads = hf.num_attention_heads
        rope = dict(fam.rope)
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        eos_ids += tuple(int(e) for e in extra_eos if int(e) not in eos_ids)
        return cls(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            vocab_size=hf.vocab_size,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            max_position=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=fam.qkv_bias,
            eos_token_ids=eos_ids,
            rope_parameters=fam.rope,
            layer_windows=fam.layer_windows,
            family=fam.family,
            activation=fam.activation,
            attn_softcap=fam.attn_softcap,
            final_softcap=fam.final_softcap,
            attn_scale=fam.attn_scale,
            embed_scale=fam.embed_scale,
            o_bias=fam.o_bias,
            sliding_rope_parameters=fam.sliding_rope,
        )


# Named shapes for benchmarks with random ("dummy") weights: speed does not depend on weight values.
NAMED_CONFIGS: dict[str, ModelConfig] = {
    "llama-2-7b": ModelConfig(
        num_layers=32, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32,
        head_dim=128, vocab_size=32000, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=4096,
        tie_word_embeddings=False, eos_token_ids=(2,),
    ),
    "llama-3-8b": ModelConfig(
        num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
        head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position=8192,
        tie_word_embeddings=False, eos_token_ids=(128001, 128009),
    ),
    # The Llama-3-8B shape with its 128k window (llama3 rope scaling): long-context benchmarks.
    "llama-3.1-8b": ModelConfig(
        num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
        head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position=131072,
        tie_word_embeddings=False, eos_token_ids=(128001, 128008, 128009),
        rope_parameters=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                         ("original_max_position_embeddings", 8192), ("rope_type", "llama3")),
    ),
    "tiny-llama": ModelConfig(  # for tests: a few layers, GQA, small vocab
        num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
        head_dim=16, vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=512,
        tie_word_embeddings=True, eos_token_ids=(2,),
    ),
    # tiny-llama with the large models' head_dim: for tests of the kernels that need 64 or 128
    "tiny-llama-hd128": ModelConfig(
        num_layers=2, hidden_size=512, intermediate_size=1024, num_heads=4, num_kv_heads=2,
        head_dim=128, vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=1024,
        tie_word_embeddings=True, eos_token_ids=(2,),
    ),
}
