"""StreamChunks of one stream -> Completion (joined deltas, summed counts, timings)."""

from __future__ import annotations

from typing import Optional

from .errors import ProtocolError, ServerError
from .types import Completion, StreamChunk


class CompletionAssembler:
    """Accumulates the chunks of one stream; ``build()`` freezes them into a Completion.

    Only the owner of the stream touches it (single-threaded by construction).
    """

    def __init__(self, model: str, request_id: str, sent_at: float) -> None:
        self.model = model
        self.request_id = request_id
        self.sent_at = sent_at
        self._text: list[str] = []
        self._ids: list[int] = []
        self._finish_reason: Optional[str] = None
        self._num_input: Optional[int] = None
        self._num_output: Optional[int] = None
        self._cached: Optional[int] = None
        self._num_responses = 0
        self._content_times: list[float] = []
        self._content_tokens: list[int] = []
        self._last_time = sent_at
        self.done = False

    def add(self, chunk: StreamChunk) -> None:
        if self.done:
            raise ProtocolError(f"response #{chunk.index} arrived after the final response")
        self._num_responses += 1
        self._last_time = chunk.received_at
        if chunk.text:
            self._text.append(chunk.text)
        self._ids.extend(chunk.token_ids)
        if chunk.num_output_tokens is not None:
            # Per-response counts are deltas (contract); sum them.
            self._num_output = (self._num_output or 0) + chunk.num_output_tokens
        if chunk.has_content:
            self._content_times.append(chunk.received_at)
            self._content_tokens.append(
                chunk.num_output_tokens if chunk.num_output_tokens is not None else max(len(chunk.token_ids), 1)
            )
        # Metadata may come with any response (first, last or all): keep the latest value seen.
        if chunk.num_input_tokens is not None:
            self._num_input = chunk.num_input_tokens
        if chunk.cached_tokens is not None:
            self._cached = chunk.cached_tokens
        if chunk.finish_reason is not None:
            self._finish_reason = chunk.finish_reason
        if chunk.is_final:
            self.done = True

    def build(self, *, cancelled: bool = False, finished_at: Optional[float] = None) -> Completion:
        """Freeze what arrived. A client-side cancel reports finish_reason 'cancelled'."""
        reason = self._finish_reason
        if cancelled and reason is None:
            reason = "cancelled"
        return Completion(
            model=self.model,
            request_id=self.request_id,
            text="".join(self._text),
            token_ids=tuple(self._ids),
            finish_reason=reason,
            num_input_tokens=self._num_input,
            num_output_tokens=self._num_output,
            cached_tokens=self._cached,
            num_responses=self._num_responses,
            sent_at=self.sent_at,
            finished_at=self._last_time if finished_at is None else finished_at,
            content_times=tuple(self._content_times),
            content_tokens=tuple(self._content_tokens),
            cancelled=cancelled,
        )


def check_finished_ok(completion: Completion) -> Completion:
    """Raise ServerError for a stream the server ended with finish_reason 'error'.

    The contract puts a message on an error *response*; a bare 'error' finish reason still means
    the completion is not usable, so it must not pass silently as a short answer.
    """
    if completion.finish_reason == "error" and not completion.cancelled:
        raise ServerError(
            f"the server finished the request with finish_reason=error after {completion.num_responses} responses",
            model=completion.model,
            request_id=completion.request_id or None,
        )
    return completion
