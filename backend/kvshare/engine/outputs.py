"""What the engine hands to its caller for each request, step by step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestTiming:
    """A finished request's timeline (wall-clock ns, as TensorRT-LLM's perf metrics) and its pages."""
    arrival_ns: int
    first_scheduled_ns: int
    first_token_ns: int
    last_token_ns: int
    kv_reused_pages: int              # full pages taken from the prefix cache or a forked parent
    kv_new_pages: int                 # pages this request allocated itself
    kv_total_pages: int               # pages in its page table at the end


@dataclass(frozen=True)
class Beam:
    """One finished beam of a beam search, best first in RequestOutput.beams."""
    token_ids: tuple[int, ...]
    text: str
    cum_logprob: float                # sum of its tokens' log-probabilities
    score: float                      # cum_logprob / len ** length_penalty: what ranks the beams
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    token_ids: tuple[int, ...]        # new tokens since the previous output
    text: str                         # new text since the previous output
    finished: bool
    finish_reason: str | None         # stop | length | cancelled | error (on the final output)
    num_prompt_tokens: int
    num_output_tokens: int            # total generated so far
    cached_tokens: int                # prompt tokens served from shared pages
    error: str | None = None
    logprobs: tuple[float, ...] = ()  # one per token in token_ids, when the request asked (logprobs >= 0)
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()   # per token: the logprobs > 0 best (id, logprob)
    generation_logits: tuple[Any, ...] = ()   # fp32 [V] host tensors, one per token, when asked
    context_logits: Any = None        # fp32 [prompt_len, V] host tensor on the first output, when asked
    timing: RequestTiming | None = None       # on the final output
    beams: tuple[Beam, ...] = ()      # beam search: the final output's beams, best first


@dataclass(frozen=True)
class StepShape:
    """What the engine's last step ran (benchmarks' step profiles; not used by serving)."""
    decode_rows: int                  # one-token chunks
    prefill_tokens: int               # tokens of longer chunks (prompt prefill)
    path: str                         # the runner's path: graph | cascade-graph | cascade | eager | none


class InvalidRequest(ValueError):
    """A request the engine cannot serve; ``field`` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (the sender coalesces when it falls behind)."""
    if first.request_id != then.request_id or first.finished:
        raise ValueError("only consecutive outputs of one unfinished request merge")
    return RequestOutput(
        then.request_id, first.token_ids + then.token_ids, first.text + then.text, then.finished,
        then.finish_reason, then.num_prompt_tokens, then.num_output_tokens, then.cached_tokens, then.error,
        first.logprobs + then.logprobs, first.top_logprobs + then.top_logprobs,
        first.generation_logits + then.generation_logits,
        first.context_logits if first.context_logits is not None else then.context_logits, then.timing, then.beams)


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Merges each request's outputs in a batch, keeping per-request order; requests keep first-seen order."""
    merged: dict[str, RequestOutput] = {}
    for out in outputs:
        prev = merged.get(out.request_id)
        merged[out.request_id] = out if prev is None else merge_outputs(prev, out)
    return list(merged.values())
