"""The shape of a Llama-family model, independent of where its weights come from."""
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

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        heads = hf.num_attention_heads
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
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
            qkv_bias=bool(getattr(hf, "attention_bias", False)) or hf.model_type == "qwen2",
            eos_token_ids=eos_ids,
            rope_parameters=tuple(sorted((k, v) for k, v in rope.items() if isinstance(v, (int, float, str)))),
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
