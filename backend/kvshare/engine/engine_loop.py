"""Runs an LLMEngine on its own thread for the life of the server process.

Callers (Triton's execute(), tests) submit requests with a sink that receives every RequestOutput
(or a batch sink that receives each step's outputs as one list) and an optional ``is_cancelled``
probe; a watcher thread polls the probes a few times a second, so a client that hangs up ends its
request and frees its pages. The same thread ends a request whose timeout passed, and asks the
optional ``serving`` probe a couple of times a second whether the server still serves this model:
once it says no (Triton is shutting down or unloading the model), every request in flight ends at
once (Triton waits for them before it finalizes the model; docs/operate/troubleshoot.md). Every submitted
request gets exactly one final output, whatever happens: finish, stop, cancel, timeout, engine error
(a step that raises, anywhere in the loop) or shutdown.

The engine thread does nothing but steps and their bookkeeping: in the Triton stub every probe is
an IPC round trip to the server process, and on the engine thread 64 of them every 50 ms took ~9%
of the steps' time (docs/develop/engine.md).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..sampling_params import SamplingParams
from .cancel_probes import CancelProbes
from .engine import LLMEngine
from .faults import FaultInjector
from .outputs import RequestOutput
from .step_meter import StepMeter

log = logging.getLogger("kvshare.engine")

Sink = Callable[[RequestOutput], None]
BatchSink = Callable[[list[RequestOutput]], None]


@dataclass(frozen=True)
class Submission:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str
    echo_prompt: bool
    sink: Sink | None
    is_cancelled: Callable[[], bool] | None
    # Takes this request's outputs instead of `sink`: one call per step with the outputs of every
    # request that names the same batch sink, so its consumer wakes once per step, not per token.
    batch_sink: BatchSink | None = None
    fork_of: str | None = None          # an earlier submission with the same prompt: share its prefill
    # From submission to the final output, queued or running; past it the request ends with an
    # error and its pages return. None: no limit.
    timeout_s: float | None = None


class EngineLoop:
    def __init__(self, engine: LLMEngine, *, cancel_poll_s: float = 0.05, idle_tick_s: float = 0.5,
                 on_tick: Callable[[LLMEngine], None] | None = None, max_in_flight: int | None = None,
                 faults: FaultInjector | None = None, serving: Callable[[], bool] | None = None,
                 serving_poll_s: float = 0.5, step_log_s: float = 0.0, label: str = ""):
        self.engine = engine
        self._step_log_s = step_log_s   # log the steps' periods this often (step_meter.py); 0 = never
        self._label = label             # "engine 1: " beside others in one process, else empty
        self._faults = faults          # tests only (faults.py): slow steps
        self._serving = serving
        self._serving_poll_s = serving_poll_s
        self.draining = False           # set once the server stopped serving this model: submissions are refused
        # Admission control: past this many accepted-but-unfinished requests, try_submit refuses, so
        # overload turns into a clear error for the client instead of unbounded queue growth.
        self.max_in_flight = max_in_flight
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._subs: dict[str, Submission] = {}
        self._probes = CancelProbes()                          # polled by the watcher thread
        self._deadlines: dict[str, tuple[float, float]] = {}   # rid -> (monotonic deadline, timeout_s); watcher's
        self._deadline_lock = threading.Lock()
        self._cancel_poll_s = cancel_poll_s
        self._idle_tick_s = idle_tick_s
        self._on_tick = on_tick
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvshare-engine", daemon=True)
        self._thread.start()
        self._watcher = threading.Thread(target=self._watch_cancellations, name="kvshare-cancel-watch", daemon=True)
        self._watcher.start()
        self._serving_watcher = None
        if serving is not None:
            self._serving_watcher = threading.Thread(target=self._watch_serving, name="kvshare-serving-watch",
                                                     daemon=True)
            self._serving_watcher.start()

    def submit(self, sub: Submission) -> None:
        if not self.try_submit(sub):
            raise OverflowError(f"{self._in_flight} requests in flight (limit {self.max_in_flight})")

    def try_submit(self, sub: Submission) -> bool:
        """Queues the request unless max_in_flight requests are already accepted and unfinished."""
        return self.try_submit_all([sub])

    def try_submit_all(self, subs: list[Submission]) -> bool:
        """Queues all of them, in order, or none (a batched or n-sequence request is one decision)."""
        with self._count_lock:
            if self.draining or (self.max_in_flight is not None and self._in_flight + len(subs) > self.max_in_flight):
                return False
            self._in_flight += len(subs)
            now = time.monotonic()
            # queued under the lock: a drain decided after this check is queued after these adds
            for sub in subs:
                self._inbox.put(("add", (sub, None if sub.timeout_s is None else now + sub.timeout_s)))
        return True

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def abandon(self, request_id: str) -> None:
        """The request's client can no longer be answered and its caller ends the Triton request
        itself: its cancellation probe stops now, on the calling thread, before that final goes out
        (in the stub a probe after the final reads freed memory), and the engine ends it."""
        self._probes.drop(request_id)
        self.cancel(request_id)

    def drain(self) -> None:
        """The server no longer serves this model: refuse new requests, end those in flight."""
        with self._count_lock:
            self.draining = True
        self._inbox.put(("drain", None))

    def call(self, fn: Callable[[LLMEngine], object], timeout: float = 30.0) -> object:
        """Runs fn(engine) on the engine thread (e.g. a consistent stats snapshot)."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox.put(("call", (fn, done)))
        ok, value = done.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)
        self._watcher.join(timeout)
        if self._serving_watcher is not None:
            self._serving_watcher.join(timeout)

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        last_tick = time.monotonic()
        meter = StepMeter(self._step_log_s, last_tick)
        step_start, shape = None, None
        while not self._stopping.is_set():
            try:
                waited = not self.engine.has_work
                self._drain_inbox(block=waited)
                now = time.monotonic()
                was_busy = self.engine.has_work
                if was_busy:
                    if meter.interval_s > 0:
                        if step_start is not None and not waited:
                            meter.add(shape, now - step_start)    # the last step's period: start to start
                        step_start = now
                    self._step()
                    if meter.interval_s > 0:
                        shape = self.engine.last_step
                line = meter.report(now)
                if line is not None:
                    log.info("%ssteps: %s", self._label, line)
            except Exception as exc:
                # Whatever raised (a step, an add, a cancel), the thread lives on: a dead engine thread
                # would leave every request in flight, and every later one, without a final response.
                log.exception("engine loop failed; ending the %d requests in flight", len(self._subs))
                self._fail_all(f"internal engine error: {exc}")
                now, was_busy = time.monotonic(), True
            # Tick on schedule, and at once when the engine falls idle, so that gauges read right
            # after the last request ends already show the empty pool.
            went_idle = was_busy and not self.engine.has_work
            if self._on_tick is not None and (went_idle or now - last_tick >= self._idle_tick_s):
                last_tick = now
                self._safe(self._on_tick, self.engine)
        self._fail_all("the server is shutting down", reason="cancelled")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self._idle_tick_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            sub, deadline = payload
            self._subs[sub.request_id] = sub
            if sub.is_cancelled is not None:
                self._probes.add(sub.request_id, sub.is_cancelled)
            if deadline is not None:
                with self._deadline_lock:
                    self._deadlines[sub.request_id] = (deadline, sub.timeout_s)
            try:
                self.engine.add_request(sub.request_id, sub.prompt_ids, sub.params, cache_salt=sub.cache_salt,
                                        echo_prompt=sub.echo_prompt, fork_of=sub.fork_of)
            except Exception as exc:  # validated before submit; this is the backstop
                self._deliver([RequestOutput(sub.request_id, (), "", True, "error", len(sub.prompt_ids), 0, 0, str(exc))])
        elif kind == "cancel":
            # a batched or n-sequence request's members are "<id>/<row>.<seq>": a cancel ends them all
            ids = [payload] + [r for r in self.engine.request_ids() if r.startswith(payload + "/")]
            outs = [self.engine.abort(rid, "cancelled") for rid in ids]
            self._deliver([out for out in outs if out])
        elif kind == "expire":
            rid, timeout_s = payload
            if rid in self._subs:
                out = self.engine.abort(rid, "error", f"timeout: the request did not finish within its timeout of "
                                                      f"{timeout_s * 1000:.0f} ms and was ended")
                self._deliver([out] if out else [])
        elif kind == "drain":
            log.warning("the server no longer serves this model (shutdown or unload): ending the %d requests "
                        "in flight", len(self._subs))
            self._fail_all("the server is shutting down", reason="cancelled")
        elif kind == "call":
            fn, done = payload
            try:
                done.put((True, fn(self.engine)))
            except Exception as exc:
                done.put((False, exc))

    def _watch_cancellations(self) -> None:
        """Watcher thread: a probe that fires turns into a cancel in the engine's inbox, a deadline
        that passes into an expiry."""
        while not self._stopping.wait(self._cancel_poll_s):
            if self._deadlines:
                now = time.monotonic()
                with self._deadline_lock:
                    expired = [(rid, t) for rid, (at, t) in self._deadlines.items() if at <= now]
                    for rid, t in expired:
                        del self._deadlines[rid]
                for rid, t in expired:
                    self._inbox.put(("expire", (rid, t)))
            for rid in self._probes.fired():
                self.cancel(rid)

    def _watch_serving(self) -> None:
        """Serving thread (its own: a slow answer must not hold back cancellations): the serving
        probe's first "no" drains, and no call is made after it, the server is going away. None:
        cannot tell (e.g. before the first request)."""
        while not self._stopping.wait(self._serving_poll_s):
            if self._safe(self._serving) is False:
                self.drain()
                return

    def _step(self) -> None:
        if self._faults is not None:
            self._faults.slow_step()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; ending the %d requests in flight", len(self._subs))
            self._fail_all(f"internal engine error: {exc}")
            return
        self._deliver(outputs)

    def _fail_all(self, message: str, reason: str = "error") -> None:
        """Ends every request in flight with `reason`. A step that raised may already have built the
        final output of a request that finished earlier in the same step; that output is lost with
        the step, and the engine no longer holds the request, so abort_all cannot end it: every
        submission still open gets its final here instead."""
        try:
            outputs = self.engine.abort_all(reason, message)
        except Exception:
            log.exception("aborting the requests in flight failed; their pages may be lost")
            outputs = []
        ended = {out.request_id for out in outputs if out.finished}
        outputs += [RequestOutput(rid, (), "", True, reason, len(sub.prompt_ids), 0, 0, message)
                    for rid, sub in self._subs.items() if rid not in ended]
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        deliver(outputs, self._subs, self._finished)

    def _finished(self, request_id: str) -> None:
        # before the final goes out: no probe may run after it (cancel_probes.py)
        self._probes.drop(request_id)
        with self._deadline_lock:
            self._deadlines.pop(request_id, None)
        with self._count_lock:
            self._in_flight -= 1

    @staticmethod
    def _safe(fn, *args):
        return safe_call(fn, *args)

def deliver(outputs: list[RequestOutput], subs: dict[str, Submission], finished: Callable[[str], None]) -> None:
    """Hands outputs to their submissions' sinks, one call per batch sink. A final output first
    removes its submission and calls finished(request id), before any sink sees it."""
    batches: dict[BatchSink, list[RequestOutput]] = {}
    for out in outputs:
        sub = subs.get(out.request_id)
        if sub is None:
            continue
        if out.finished:
            del subs[out.request_id]
            finished(out.request_id)
        if sub.batch_sink is not None:
            batches.setdefault(sub.batch_sink, []).append(out)
        elif sub.sink is not None:
            safe_call(sub.sink, out)
    for batch_sink, batch in batches.items():
        safe_call(batch_sink, batch)


def safe_call(fn, *args):
    try:
        return fn(*args)
    except Exception:
        log.exception("callback %r failed", fn)
        return None
