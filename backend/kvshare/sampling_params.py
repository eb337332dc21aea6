"""What a request asks of generation. Pure data shared by every layer (no torch)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 means no top-k
    min_tokens: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0   # HF style, over prompt and output tokens
    presence_penalty: float = 0.0     # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()        # matched on decoded text; never emitted
    ignore_eos: bool = False          # benchmarks: force the requested output length

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
