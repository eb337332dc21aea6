"""What a request may ask of an engine, and the check that says which field asks too much.

Frozen data with no engine behind it: the adapter validates a request before it reaches an engine,
also when the engine runs in another process (engine/engine_process.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..sampling_params import SamplingParams
from .outputs import InvalidRequest


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int                # context length: prompt plus generated tokens
    capacity_tokens: int              # the whole page pool
    max_prompt_tokens: int | None
    max_beam_width: int
    max_logits_elements: int

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequest naming the field for anything this engine cannot serve."""
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequest("input_ids", "the prompt is empty")
        vocab = self.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest("input_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if n >= self.max_model_len:
            raise InvalidRequest("input_ids", f"the prompt has {n} tokens; the context holds {self.max_model_len} "
                                              "and at least one must be left to generate")
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise InvalidRequest("input_ids", f"the prompt has {n} tokens, more than max_prompt_tokens "
                                              f"({self.max_prompt_tokens})")
        if params.max_tokens <= 0:
            raise InvalidRequest("max_tokens", f"must be > 0, got {params.max_tokens}")
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequest("max_tokens", f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the context "
                                               f"length {self.max_model_len}")
        if n + params.max_tokens > self.capacity_tokens:
            raise InvalidRequest("max_tokens", f"prompt ({n}) + max_tokens ({params.max_tokens}) needs more KV than the "
                                               f"whole page pool holds ({self.capacity_tokens} tokens)")
        if params.min_tokens > params.max_tokens:
            raise InvalidRequest("min_tokens", f"min_tokens ({params.min_tokens}) exceeds max_tokens ({params.max_tokens})")
        for name, ids in (("bad_words", [t for w in params.bad_words for t in w]),
                          ("embedding_bias", [t for t, _ in params.logit_bias]),
                          ("end_id", list(params.end_ids or ()))):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(name, f"token id {bad} is outside the vocabulary [0, {vocab})")
        if params.beam_width < 1 or params.beam_width > self.max_beam_width:
            raise InvalidRequest("beam_width", f"must be in [1, {self.max_beam_width}], got {params.beam_width}")
        if params.logprobs > vocab:
            raise InvalidRequest("logprobs", f"must be <= the vocabulary size {vocab}, got {params.logprobs}")
        if params.return_generation_logits and params.max_tokens * vocab > self.max_logits_elements:
            raise InvalidRequest("return_generation_logits", (
                f"max_tokens ({params.max_tokens}) x vocabulary ({vocab}) = {params.max_tokens * vocab} logits exceeds "
                f"max_logits_elements ({self.max_logits_elements}); lower max_tokens or raise the limit"))
        if params.return_context_logits and n * vocab > self.max_logits_elements:
            raise InvalidRequest("return_context_logits", (
                f"prompt ({n}) x vocabulary ({vocab}) = {n * vocab} logits exceeds max_logits_elements "
                f"({self.max_logits_elements})"))
