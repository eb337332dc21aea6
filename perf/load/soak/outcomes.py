"""What happened to each request the soak sent, and whether that was the expected thing.

Every request has a kind (what was sent and how the client behaves) and ends in one result. A
result is *expected* only for the kinds that ask for it: an overload refusal is expected of a
burst, and of any request sent while a burst is in flight (or within a few seconds after it, the
admission count trails the cancels); a refusal naming the field is expected of a bad input and of
nothing else. Everything unexpected is a failure of the soak.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from kvshare_client.errors import ProtocolError, ServerError, ServerUnavailable, StreamTimeout
from kvshare_client.types import Completion

# Kinds of request.
STREAM = "stream"            # streamed to the end
NON_STREAM = "non_stream"    # stream=false: one response with the whole text
CANCEL = "cancel"            # the client cancels the gRPC stream after a few responses
CLOSE = "disconnect_close"   # the client closes its channel mid-stream
KILL = "disconnect_kill"     # a client subprocess is killed (SIGKILL) mid-stream
BAD_INPUT = "bad_input"      # an invalid request: must be refused naming the field
BURST = "burst"              # one of a burst past max_queued_requests
KINDS = (STREAM, NON_STREAM, CANCEL, CLOSE, KILL, BAD_INPUT, BURST)

# Results.
COMPLETED = "completed"
CANCELLED = "cancelled"
DISCONNECTED = "disconnected"
REJECTED = "rejected_naming_field"
OVERLOADED = "overloaded"
ACCEPTED_BAD_INPUT = "accepted_bad_input"
REJECTED_UNNAMED = "rejected_without_field"
HUNG = "hung"
UNAVAILABLE = "unavailable"
PROTOCOL = "protocol_error"
SERVER_ERROR = "server_error"
WRONG_SHAPE = "wrong_response_count"
CLIENT_ERROR = "client_exception"

_EXPECTED = {
    STREAM: {COMPLETED},
    NON_STREAM: {COMPLETED},
    CANCEL: {CANCELLED, COMPLETED},        # COMPLETED: the answer ended before the cancel point
    CLOSE: {DISCONNECTED, COMPLETED},
    KILL: {DISCONNECTED, COMPLETED},
    BAD_INPUT: {REJECTED},
    BURST: {OVERLOADED, CANCELLED, COMPLETED},
}
FINISH_REASONS = frozenset({"stop", "length", None})   # None: vllm_model sends no finish_reason unasked


class ClientCancel(Exception):
    """Raised from a chunk callback: the client gives up on the stream (cancel or disconnect)."""


@dataclass(frozen=True)
class Outcome:
    kind: str
    model: str
    result: str
    expected: bool
    detail: str
    at: float                       # time.time() when it ended
    ttft_s: Optional[float] = None  # streamed requests that completed


def is_overload(message: str) -> bool:
    return "overloaded" in message and "max_queued_requests" in message


def classify_error(kind: str, exc: BaseException, *, field: Optional[str], gave_up: str,
                   overload_expected: bool) -> tuple[str, bool, str]:
    """(result, expected, detail) of a request that raised exc; gave_up: the result a ClientCancel means."""
    if isinstance(exc, ClientCancel):
        result, detail = gave_up, ""
    elif isinstance(exc, ServerError):
        detail = exc.message
        if is_overload(exc.message):
            return OVERLOADED, kind == BURST or overload_expected, detail
        if kind == BAD_INPUT:
            result = REJECTED if field and field in exc.message else REJECTED_UNNAMED
        else:
            result = SERVER_ERROR
    elif isinstance(exc, StreamTimeout):
        result, detail = HUNG, str(exc)
    elif isinstance(exc, ServerUnavailable):
        result, detail = UNAVAILABLE, str(exc)
    elif isinstance(exc, ProtocolError):
        result, detail = PROTOCOL, str(exc)
    else:
        result, detail = CLIENT_ERROR, f"{type(exc).__name__}: {exc}"
    return result, result in _EXPECTED[kind], detail


def classify_completion(kind: str, completion: Completion) -> tuple[str, bool, str]:
    """(result, expected, detail) of a request that reached its final response."""
    if kind == BAD_INPUT:
        return ACCEPTED_BAD_INPUT, False, f"{completion.num_responses} responses, text {completion.text[:60]!r}"
    if completion.finish_reason not in FINISH_REASONS:
        return SERVER_ERROR, False, f"finish_reason={completion.finish_reason}"
    if kind == NON_STREAM:
        content = sum(1 for _ in completion.content_times)
        if content != 1:
            return WRONG_SHAPE, False, f"non-streamed request got {content} responses with content"
    return COMPLETED, True, ""


class OutcomeLog:
    """Thread-safe tally of outcomes, the burst windows, and the first few unexpected details."""

    def __init__(self, overload_grace_s: float = 10.0, keep_details: int = 50) -> None:
        self.overload_grace_s = overload_grace_s
        self._keep = keep_details
        self._lock = threading.Lock()
        self.counts: Counter = Counter()
        self.unexpected: list[dict] = []
        self.ttfts: list[tuple[float, float]] = []   # (time, seconds) of completed streams
        self.bursts: list[dict] = []
        self.bursts_interrupted = 0
        self._bursts_open = 0
        self._last_burst_end = float("-inf")
        # Set when the run winds down: the paced users start nothing new, so that no burst is cut.
        self.closing = False

    def overload_expected(self, sent_at: float) -> bool:
        """Whether a request sent at sent_at (time.time()) may meet a full queue: a burst was on."""
        with self._lock:
            return self._bursts_open > 0 or sent_at <= self._last_burst_end + self.overload_grace_s

    def burst_started(self) -> None:
        with self._lock:
            self._bursts_open += 1

    def burst_ended(self, size: int, refused: int, hung: int) -> None:
        with self._lock:
            self._bursts_open -= 1
            self._last_burst_end = time.time()
            self.bursts.append({"at": round(self._last_burst_end, 1), "size": size, "refused": refused, "hung": hung})

    def burst_interrupted(self) -> None:
        with self._lock:
            self._bursts_open -= 1
            self._last_burst_end = time.time()
            self.bursts_interrupted += 1

    @property
    def bursts_open(self) -> int:
        with self._lock:
            return self._bursts_open

    def record(self, outcome: Outcome) -> None:
        with self._lock:
            self.counts[(outcome.kind, outcome.model, outcome.result, outcome.expected)] += 1
            if outcome.ttft_s is not None:
                self.ttfts.append((outcome.at, outcome.ttft_s))
            if not outcome.expected and len(self.unexpected) < self._keep:
                self.unexpected.append({"kind": outcome.kind, "model": outcome.model, "result": outcome.result,
                                        "detail": outcome.detail[:300], "at": round(outcome.at, 1)})

    def totals(self) -> dict:
        """requests, unexpected, and counts by kind/result/model for the summary."""
        with self._lock:
            items = list(self.counts.items())
        by_kind: dict = {}
        by_model: Counter = Counter()
        for (kind, model, result, expected), n in items:
            by_kind.setdefault(kind, Counter())[result + ("" if expected else " (UNEXPECTED)")] += n
            by_model[model] += n
        return {
            "requests": sum(n for _, n in items),
            "unexpected": sum(n for (_, _, _, ok), n in items if not ok),
            "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
            "by_model": dict(sorted(by_model.items())),
            "by_kind_model": {f"{kind} {model} {result}" + ("" if ok else " (UNEXPECTED)"): n
                              for (kind, model, result, ok), n in sorted(items)},
        }
