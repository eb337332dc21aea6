"""The values that cross the client's module boundaries: what to generate and what came back.

All of them are frozen: a request can be reused for many streams, and chunks/completions can be
handed to other threads (Locust greenlets, asyncio tasks) without copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

# The two models of the wire contract (docs/develop/architecture.md, /work/shared/design.md).
TEXT_MODEL = "ensemble"
TOKEN_MODEL = "llm_engine"
# The same text contract as `ensemble`, served by a BLS model whose cancels reach the engine
# (Triton 2.51 does not cancel a running ensemble step).
CANCELLABLE_TEXT_MODEL = "llm_bls"


def _as_tuple(values: Optional[Iterable], kind: type, field_name: str) -> Optional[tuple]:
    """Normalise list-like user input to an immutable tuple, checking the element type."""
    if values is None:
        return None
    if isinstance(values, (str, bytes)) and kind is str:
        # A single stop word given as a bare string is an easy mistake: treat it as one word,
        # never as a sequence of characters.
        values = (values,)
    out = tuple(values)
    for v in out:
        # numpy integers are accepted too (anything with __index__): tokenizers often return them.
        if kind is int and (isinstance(v, bool) or not hasattr(v, "__index__")):
            raise TypeError(f"{field_name}: expected integers, got {type(v).__name__}")
        if kind is str and not isinstance(v, str):
            raise TypeError(f"{field_name}: expected strings, got {type(v).__name__}")
    if kind is int:
        out = tuple(v.__index__() for v in out)
    return out


@dataclass(frozen=True)
class GenerationRequest:
    """One completion to generate.

    Exactly one of ``prompt`` (for the text model ``ensemble``) and ``input_ids`` (for the token
    model ``llm_engine``) is set. Every other field defaults to ``None`` = *not sent*, so that the
    server's defaults apply; only fields the caller sets travel on the wire.
    """

    prompt: Optional[str] = None
    input_ids: Optional[Sequence[int]] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_tokens: Optional[int] = None
    seed: Optional[int] = None
    stop_words: Optional[Sequence[str]] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    # True: one response per new text delta; False: one response with the whole text.
    stream: Optional[bool] = None
    exclude_input_in_output: Optional[bool] = None
    cache_salt: Optional[str] = None
    # Extra optional BOOL input of the ensemble: True = wrap the prompt in the model's chat template.
    apply_chat_template: Optional[bool] = None
    return_num_input_tokens: Optional[bool] = None
    return_num_output_tokens: Optional[bool] = None
    # Extra optional BOOL input of both models: True = keep generating past EOS (benchmarks force
    # output lengths this way, or with min_tokens = max_tokens).
    ignore_eos: Optional[bool] = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("GenerationRequest needs exactly one of prompt= and input_ids=")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise TypeError(f"prompt: expected str, got {type(self.prompt).__name__}")
        # Frozen dataclass: normalise through object.__setattr__ so that equal requests compare
        # equal and nobody can mutate a list the request still refers to.
        object.__setattr__(self, "input_ids", _as_tuple(self.input_ids, int, "input_ids"))
        object.__setattr__(self, "stop_words", _as_tuple(self.stop_words, str, "stop_words"))

    @property
    def is_text(self) -> bool:
        return self.prompt is not None


@dataclass(frozen=True)
class StreamChunk:
    """One response of a stream, decoded.

    ``num_output_tokens`` is the count of *this* response (a delta), as the contract says.
    A response that only carries the final flag has empty ``text`` and ``token_ids``.
    """

    index: int  # 0-based position of the response within its stream
    text: str  # decoded text delta ('' when the response carries none)
    token_ids: tuple[int, ...]  # new token ids (llm_engine's output_ids), () when absent
    finish_reason: Optional[str]  # 'stop' | 'length' | 'cancelled' | 'error' on the last response
    num_input_tokens: Optional[int]
    num_output_tokens: Optional[int]
    cached_tokens: Optional[int]
    is_final: bool  # the server's triton_final_response flag
    received_at: float  # time.perf_counter() when the client got it

    @property
    def has_content(self) -> bool:
        return bool(self.text) or bool(self.token_ids) or bool(self.num_output_tokens)


@dataclass(frozen=True)
class Completion:
    """A finished stream: the joined text/tokens, server counts and client-side timings.

    Times are ``time.perf_counter()`` values: only differences between them mean anything.
    """

    model: str
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: Optional[str]
    num_input_tokens: Optional[int]
    num_output_tokens: Optional[int]  # sum of the per-response deltas, None if never reported
    cached_tokens: Optional[int]
    num_responses: int  # every response including the empty final one
    sent_at: float
    finished_at: float
    # Arrival time and token count of every response that carried content, in order.
    content_times: tuple[float, ...] = field(default=())
    content_tokens: tuple[int, ...] = field(default=())
    cancelled: bool = False  # True when this client cancelled the stream before the end

    @property
    def output_tokens(self) -> Optional[int]:
        """Best known number of generated tokens: server count, else ids, else None."""
        if self.num_output_tokens is not None:
            return self.num_output_tokens
        if self.token_ids:
            return len(self.token_ids)
        return None

    @property
    def ttft_s(self) -> Optional[float]:
        """Time to first token: request sent -> first response with content."""
        return self.content_times[0] - self.sent_at if self.content_times else None

    @property
    def e2e_s(self) -> float:
        return self.finished_at - self.sent_at

    @property
    def inter_chunk_s(self) -> tuple[float, ...]:
        """Gaps between consecutive content-bearing responses (several tokens may share one)."""
        t = self.content_times
        return tuple(b - a for a, b in zip(t, t[1:]))

    @property
    def itl_s(self) -> Optional[float]:
        """Mean inter-token latency after the first token (a.k.a. TPOT).

        (last content - first content) / (tokens after the first one). Token counts come from
        the server when it reports them, else one token per content response is assumed.
        """
        if len(self.content_times) < 2:
            return None
        n = self.output_tokens if self.output_tokens is not None else len(self.content_times)
        if n < 2:
            return None
        return (self.content_times[-1] - self.content_times[0]) / (n - 1)

    @property
    def tokens_per_s(self) -> Optional[float]:
        """Generated tokens over the end-to-end time."""
        n = self.output_tokens
        if n is None or self.e2e_s <= 0:
            return None
        return n / self.e2e_s

    def summary(self) -> str:
        """One line for logs and the CLI: tokens, TTFT, tok/s, cached tokens, finish reason."""

        def ms(v: Optional[float]) -> str:
            return "-" if v is None or math.isnan(v) else f"{v * 1e3:.1f}ms"

        def num(v: Optional[float], fmt: str = "{}") -> str:
            return "-" if v is None else fmt.format(v)

        return (
            f"tokens={num(self.output_tokens)} prompt_tokens={num(self.num_input_tokens)} "
            f"ttft={ms(self.ttft_s)} itl={ms(self.itl_s)} e2e={ms(self.e2e_s)} "
            f"tok/s={num(self.tokens_per_s, '{:.1f}')} cached_tokens={num(self.cached_tokens)} "
            f"finish_reason={self.finish_reason or '-'}" + (" (cancelled by client)" if self.cancelled else "")
        )


def default_model_for(request: GenerationRequest) -> str:
    """Text prompts go to the ensemble (it tokenizes), token ids straight to the engine."""
    return TEXT_MODEL if request.is_text else TOKEN_MODEL
