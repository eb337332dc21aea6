"""The soak's Locust users (import only in the soak's own process: locust patches it with gevent).

    MixUser       closed loop, no think time: streams, non-streamed requests, cancels, channel
                  closes and bad inputs across the four models (weights below)
    KillUser      paced: a client subprocess opens a stream and is SIGKILLed after its first responses
    BurstUser     paced: max_queued_requests + a few concurrent llm_engine requests at once

Each class is bound to one run by ``bind`` (host, the OutcomeLog, settings), not by module state.
"""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from kvshare_client.locust_user import fire_completion_events  # first: it sets gRPC up for gevent

import gevent  # noqa: E402
from locust import User, constant, constant_pacing, task  # noqa: E402

from kvshare_client.raw_stream import RawStreamSession  # noqa: E402
from kvshare_client.types import Completion  # noqa: E402
from kvshare_client.wire import WireTensor  # noqa: E402

from . import mix  # noqa: E402
from .outcomes import (BAD_INPUT, BURST, CANCEL, CANCELLED, CLOSE, COMPLETED, DISCONNECTED, HUNG, KILL, NON_STREAM,  # noqa: E402
                       OVERLOADED, STREAM, ClientCancel, Outcome, OutcomeLog, classify_completion, classify_error)

ROOT = Path(__file__).resolve().parents[3]


class SoakUser(User):
    abstract = True
    log: OutcomeLog
    stream_timeout_s: float = 300.0

    def on_start(self) -> None:
        self.rng = random.Random()
        self.session = RawStreamSession(self.host, stream_timeout=self.stream_timeout_s)

    def on_stop(self) -> None:
        self.session.close()

    def send(self, kind: str, model: str, tensors: tuple[WireTensor, ...], *, field: Optional[str] = None,
             give_up_after: Optional[int] = None, gave_up: str = CANCELLED, on_give_up: Any = None,
             session: Optional[RawStreamSession] = None) -> Outcome:
        """Run one request to its end (or until the client gives up) and record what happened."""
        session = session or self.session
        sent = time.time()
        t0 = time.perf_counter()
        seen = 0

        def on_chunk(_chunk: Any) -> None:
            nonlocal seen
            seen += 1
            if give_up_after is not None and seen >= give_up_after:
                if on_give_up is not None:
                    on_give_up()
                raise ClientCancel()

        completion: Optional[Completion] = None
        try:
            completion = session.generate(model, tensors, on_chunk=on_chunk)
            result, expected, detail = classify_completion(kind, completion)
            error: Optional[BaseException] = None
        except Exception as exc:
            error = exc
            result, expected, detail = classify_error(kind, exc, field=field, gave_up=gave_up,
                                                      overload_expected=self.log.overload_expected(sent))
        ttft = completion.ttft_s if completion is not None and kind == STREAM else None
        outcome = Outcome(kind, model, result, expected, detail, time.time(), ttft)
        self.log.record(outcome)
        self._fire(kind, model, outcome, completion, error, sent, t0)
        return outcome

    def _fire(self, kind: str, model: str, outcome: Outcome, completion: Optional[Completion],
              error: Optional[BaseException], sent: float, t0: float) -> None:
        """Locust's own statistics: one row per kind and model; only unexpected outcomes are failures."""
        if kind == STREAM and completion is not None:
            fire_completion_events(self.environment, model, completion, sent)
            return
        self.environment.events.request.fire(
            request_type=kind, name=model, response_time=(time.perf_counter() - t0) * 1e3,
            response_length=(completion.output_tokens or 0) if completion else 0,
            exception=None if outcome.expected else (error or RuntimeError(f"{outcome.result}: {outcome.detail}")),
            context={}, start_time=sent)


class MixUser(SoakUser):
    wait_time = constant(0)

    @task(10)
    def stream(self) -> None:
        model = mix.choose_model(self.rng)
        self.send(STREAM, model, mix.request_tensors(model, mix.normal_shape(self.rng), self.rng))

    @task(3)
    def non_stream(self) -> None:
        model = mix.choose_model(self.rng)
        self.send(NON_STREAM, model, mix.request_tensors(model, mix.Shape(max_tokens=24, stream=False), self.rng))

    @task(3)
    def cancel(self) -> None:
        model = mix.choose_model(self.rng)
        self.send(CANCEL, model, mix.request_tensors(model, mix.cancel_shape(model), self.rng),
                  give_up_after=mix.abandon_after(self.rng))

    @task(1)
    def close_channel(self) -> None:
        model = mix.choose_model(self.rng)
        session = self.session
        # The channel goes away under the stream, as when a client process exits; a new one follows.
        self.send(CLOSE, model, mix.request_tensors(model, mix.cancel_shape(model), self.rng),
                  give_up_after=mix.abandon_after(self.rng), gave_up=DISCONNECTED, on_give_up=session.close)
        self.session = RawStreamSession(self.host, stream_timeout=self.stream_timeout_s)

    @task(2)
    def bad_input(self) -> None:
        model = mix.choose_model(self.rng)
        bad = mix.pick_bad_input(model, self.rng)
        self.send(BAD_INPUT, model, bad.tensors, field=bad.field)


class KillUser(SoakUser):
    """A client process that dies mid-stream: the server sees the TCP connection drop, no cancel."""

    fixed_count = 1
    pacing_s = 20.0
    wait_time = constant_pacing(20.0)

    @task
    def kill_client(self) -> None:
        if self.log.closing:
            return
        model = mix.choose_model(self.rng)
        sent = time.time()
        t0 = time.perf_counter()
        err = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen([sys.executable, "-m", "perf.load.soak.abandon_client", "--url", self.host,
                                 "--model", model, "--after", str(mix.abandon_after(self.rng))],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
        line = None
        try:
            with gevent.Timeout(self.stream_timeout_s, False):
                line = proc.stdout.readline().strip()
            exited = proc.poll()
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        # It may die just after poll() and before the kill: then its own signal is the return code.
        rc = exited if exited is not None else proc.returncode
        if line is None:
            err.seek(0)
            line = "timeout - the client's progress: " + err.read()[-300:].replace("\n", " | ")
        elif not line:
            # The client process ended before it said anything: its own failure, not a server hang.
            err.seek(0)
            line = f"exited rc={rc} " + err.read()[-300:].replace("\n", " ")
        err.close()
        status, _, detail = line.partition(" ")
        if status == "streaming":
            result, expected = DISCONNECTED, True
        elif status == COMPLETED:
            result, expected = COMPLETED, True
        elif status == "overloaded":
            result, expected = OVERLOADED, self.log.overload_expected(sent)
        elif status == "timeout":
            result, expected = HUNG, False
        elif status == "exited":
            # Killed by a signal of its own before it said anything (e.g. gRPC's abort in the client,
            # "epoll_wait error: Bad file descriptor", seen once in 442 requests): a client crash that
            # the server cannot cause; its connection dies as the kill's would. Any other early exit
            # is unexpected.
            crashed = rc is not None and rc < 0 and rc != -signal.SIGKILL
            result, expected = ("client_process_crashed", True) if crashed else ("client_process_exited", False)
        else:
            result, expected = "client_process_error", False
        outcome = Outcome(KILL, model, result, expected, line, time.time())
        self.log.record(outcome)
        self._fire(KILL, model, outcome, None, None, sent, t0)


class BurstUser(SoakUser):
    """More requests at once than the server queues: some must be refused as overloaded, none hang."""

    fixed_count = 1
    wait_time = constant_pacing(60.0)
    burst_size = 28

    @task
    def burst(self) -> None:
        if self.log.closing:
            return
        sessions = [RawStreamSession(self.host, stream_timeout=self.stream_timeout_s) for _ in range(self.burst_size)]
        shape = mix.Shape(max_tokens=64, ignore_eos=True)
        self.log.burst_started()
        jobs = []
        try:
            jobs = [gevent.spawn(self.send, BURST, "llm_engine", mix.request_tensors("llm_engine", shape, self.rng),
                                 give_up_after=1, session=s) for s in sessions]
            gevent.joinall(jobs)
        except BaseException:   # the run ends under it (GreenletExit): not a verdict on the server
            gevent.killall(jobs)
            self.log.burst_interrupted()
            raise
        finally:
            for s in sessions:
                s.close()
        outcomes = [j.value for j in jobs if j.value is not None]
        self.log.burst_ended(self.burst_size, sum(o.result == OVERLOADED for o in outcomes),
                             sum(o.result == HUNG for o in outcomes))


def bind(cls: type, host: str, log: OutcomeLog, **settings: Any) -> type:
    """A subclass of cls for one run: its host, outcome log and settings (burst_size, pacing)."""
    attrs: dict[str, Any] = {"host": host, "log": log, "abstract": False, **settings}
    if "pacing_s" in settings:
        attrs["wait_time"] = constant_pacing(settings["pacing_s"])
    return type(cls.__name__, (cls,), attrs)
