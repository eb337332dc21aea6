"""The engine thread's view of one request in flight."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer


@dataclass
class RequestState:
    request_id: str
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None
    echo_prompt: str = ""                       # sent before the first delta (exclude_input_in_output=false)
    output_ids: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    cached_tokens: int = 0
    end_ids: frozenset[int] = frozenset()       # tokens that end it (the request's end_id, else the model's EOS)
    context_logits: list = field(default_factory=list)   # host fp32 [n, V] pieces, prompt positions in order
    context_collected: int = 0                  # prompt positions whose logits are in context_logits
    internal: bool = False                      # a beam-search step's request: no metrics, outputs go to its search

    def token_slice(self, start: int, n: int) -> list[int]:
        """Tokens [start, start+n) of prompt + output, without concatenating the two (hot path)."""
        p = len(self.prompt_ids)
        if start + n <= p:
            return self.prompt_ids[start:start + n]
        if start >= p:
            return self.output_ids[start - p:start - p + n]
        return self.prompt_ids[start:] + self.output_ids[:start + n - p]
