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
    # Token sequences never generated: the last token of a word is masked whenever the output so far
    # ends with the word's other tokens (a one-token word is masked always), as TensorRT-LLM does.
    bad_words: tuple[tuple[int, ...], ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)
    end_ids: tuple[int, ...] | None = None           # tokens that end generation; None: the model's EOS
    # Log-probabilities (log_softmax of the model's raw logits, before penalties and temperature):
    # -1 none; 0 the sampled token's; k > 0 also the k most likely tokens' (beam search uses them).
    logprobs: int = -1
    return_generation_logits: bool = False
    return_context_logits: bool = False
    return_timing: bool = False       # RequestTiming on every output (TRT-LLM's return_perf_metrics), not only the last
    beam_width: int = 1               # > 1: beam search (engine.beam_search); 1: sampling as above
    length_penalty: float = 1.0       # beam search: beams rank by cum_logprob / len ** length_penalty

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits_per_row(self) -> bool:
        """Adjustments only the sampler's per-row host path applies (min_tokens' end-id ban also
        runs batched on the device: ModelRunner.launch_greedy)."""
        return self.has_penalties or bool(self.bad_words) or bool(self.logit_bias)

    @property
    def needs_logits_on_host(self) -> bool:
        """Rows whose step must hand logits (not only ids) back: log-probabilities or raw logits."""
        return self.logprobs >= 0 or self.return_generation_logits
