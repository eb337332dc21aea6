"""EngineGroup's surface for engines that run in their own process (engine/engine_process.py).

    execute() ──► try_submit_all ── Submit ──►  engine process: EngineGroup, its loops and engines
    pump ◄── batch sink ◄── reader thread ◄── Outputs (one per step), Tick, Routed, Closed

What needs the Triton stub stays here: admission (execute() answers at once), the clients'
cancellation probes (an IPC to the server that only the stub can make, cancel_probes.py), the
serving probe, and the sinks. What the engine loop would do for a final output, this side does
first too: the request's probe is dropped before its final reaches the sink.

Every request accepted here gets exactly one final output: from the engines, or, if the engine
process dies, from this side (an error naming the exit code), or at shutdown (cancelled).
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from ..core.router import RouteDecision
from ..runtime.step_threads import StepThreads
from .cancel_probes import CancelProbes
from .data_parallel import EngineTick, ParallelConfig
from .engine_config import EngineConfig
from .engine_loop import Submission, deliver, safe_call
from .outputs import RequestOutput
from .process_protocol import (Cancel, Closed, Drain, EnginesReady, Outputs, RemoteRequest, Routed, Shutdown,
                               StartEngines, StartFailed, Submit, Tick, recv, send)

log = logging.getLogger("kvshare.engine")

PYTHON_ENV = "KVSHARE_ENGINE_PYTHON"


class EngineUnavailable(RuntimeError):
    """The engine process has exited: no request can be served until the model is reloaded."""


def engine_python() -> str:
    """The interpreter for the engine process: KVSHARE_ENGINE_PYTHON, else one of this Python's
    version. Inside the Triton stub sys.executable is the stub binary, not an interpreter."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable, os.path.join(sys.exec_prefix, "bin", version),
                  os.path.join(sys.base_exec_prefix, "bin", version), shutil.which(version)]
    for path in candidates:
        if path and os.path.basename(path).startswith("python") and os.access(path, os.X_OK):
            return path
    raise EngineUnavailable(f"no {version} interpreter found for the engine process (looked at "
                            f"{', '.join(p for p in candidates if p)}); set {PYTHON_ENV}")


class EngineProcessGroup:
    def __init__(self, conn: Connection, process: subprocess.Popen, ready: EnginesReady, *,
                 max_in_flight: int | None, on_tick: Callable[[EngineTick], None] | None = None,
                 on_route: Callable[[RouteDecision], None] | None = None,
                 serving: Callable[[], bool | None] | None = None, cancel_poll_s: float = 0.05,
                 serving_poll_s: float = 0.5, early: tuple = ()):
        self.ready = ready
        self.max_in_flight = max_in_flight
        self.draining = False
        self._conn = conn
        self._process = process
        self._on_tick = on_tick
        self._on_route = on_route
        self._send_lock = threading.Lock()
        self._count_lock = threading.Lock()      # admission, the open submissions, `_dead`
        self._in_flight = 0
        self._subs: dict[str, Submission] = {}
        self._probes = CancelProbes()
        self._dead: str | None = None            # why no request can be served any more
        self._stopping = threading.Event()
        for message in early:                    # what came between EnginesReady and now (ticks)
            self._handle(message)
        self._reader = threading.Thread(target=self._read, name="kvshare-engine-reader", daemon=True)
        self._reader.start()
        self._watchers = [threading.Thread(target=self._watch_cancellations, args=(cancel_poll_s,),
                                           name="kvshare-cancel-watch", daemon=True)]
        if serving is not None:
            self._watchers.append(threading.Thread(target=self._watch_serving, args=(serving, serving_poll_s),
                                                   name="kvshare-serving-watch", daemon=True))
        for thread in self._watchers:
            thread.start()

    @classmethod
    def start(cls, config: EngineConfig, parallel: ParallelConfig, step_threads: StepThreads | None = None,
              **kwargs) -> "EngineProcessGroup":
        """Starts the engine process and waits until its engines are built (or raises with its error)."""
        python = engine_python()
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        # the stub's own import path: kvshare, its site-packages and the repository's packages
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        process = subprocess.Popen([python, "-m", "kvshare.engine.engine_process", str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), env=env, close_fds=True)
        theirs.close()            # the child holds the only other end: its exit reads as EOF here
        conn = Connection(mine.detach())
        log.info("engine process %d started (%s)", process.pid, python)
        try:
            send(conn, StartEngines(config, parallel, step_threads))
            early = []
            while not isinstance(message := recv(conn), (EnginesReady, StartFailed)):
                early.append(message)
        except (EOFError, OSError):
            code = process.wait()
            conn.close()
            raise EngineUnavailable(f"the engine process exited with code {code} while starting (its log is above)")
        if isinstance(message, StartFailed):
            process.wait()
            conn.close()
            raise EngineUnavailable(f"the engine process could not build the engines:\n{message.error}")
        return cls(conn, process, message, early=tuple(early), **kwargs)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def pid(self) -> int:
        return self._process.pid

    def try_submit_all(self, route_id: str, subs: list[Submission]) -> bool | None:
        """Queues all of subs on one engine, or refuses (None) at max_in_flight or while draining.
        Raises EngineUnavailable once the engine process has exited."""
        with self._count_lock:
            if self._dead is not None:
                raise EngineUnavailable(self._dead)
            if self.draining or (self.max_in_flight is not None and self._in_flight + len(subs) > self.max_in_flight):
                return None
            # under the lock: a death noticed after this check finds these and ends them
            self._in_flight += len(subs)
            for sub in subs:
                self._subs[sub.request_id] = sub
                if sub.is_cancelled is not None:
                    self._probes.add(sub.request_id, sub.is_cancelled)
            self._send(Submit(route_id, tuple(RemoteRequest(s.request_id, s.prompt_ids, s.params, s.cache_salt,
                                                            s.echo_prompt, s.fork_of, s.timeout_s) for s in subs)))
        return True

    def cancel(self, request_id: str) -> None:
        self._send(Cancel(request_id))

    def abandon(self, request_id: str) -> None:
        """The caller answers the request itself: its probe stops now, and the engine ends it."""
        self._probes.drop(request_id)
        self.cancel(request_id)

    def drain(self) -> None:
        with self._count_lock:
            self.draining = True
        self._send(Drain())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Asks the engine process to end every request and close its engines, and waits for it;
        one that does not stop within `timeout` is killed, and what it left open ends here."""
        self._stopping.set()
        for thread in self._watchers:
            thread.join(timeout)
        self._send(Shutdown())
        self._reader.join(timeout)
        if self._reader.is_alive():
            log.error("the engine process %d did not stop within %.0f s: killed", self._process.pid, timeout)
            self._process.kill()
            self._reader.join(5.0)
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._end_open("cancelled", "the server is shutting down")
        self._conn.close()

    # -- internals ----------------------------------------------------------------------------------

    def _send(self, message) -> None:
        with self._send_lock:
            try:
                send(self._conn, message)
            except (OSError, EOFError, ValueError):
                pass                 # the process is gone: the reader ends what is open

    def _read(self) -> None:
        closed = False
        while not closed:
            try:
                message = recv(self._conn)
            except (EOFError, OSError):
                break
            try:
                closed = self._handle(message)
            except Exception:     # the thread must live on: it alone ends the requests in flight
                log.exception("handling a message from the engine process failed")
        if closed:
            return
        if self._stopping.is_set():
            self._end_open("cancelled", "the server is shutting down")
            return
        code = _exit_code(self._process)
        log.error("the engine process %d exited unexpectedly (exit code %s): ending the %d requests in flight",
                  self._process.pid, code, len(self._subs))
        self._end_open("error", f"the engine process exited unexpectedly (exit code {code}); the model must "
                                "be reloaded or the server restarted")

    def _handle(self, message) -> bool:
        """One message from the engine process; True once it says Closed."""
        if isinstance(message, Outputs):
            deliver(message.outputs, self._subs, self._finished)
        elif isinstance(message, Tick):
            if self._on_tick is not None:
                safe_call(self._on_tick, message.tick)
        elif isinstance(message, Routed):
            if self._on_route is not None:
                safe_call(self._on_route, message.decision)
        elif isinstance(message, Closed):
            return True
        else:
            log.error("unknown message from the engine process: %r", type(message).__name__)
        return False

    def _finished(self, request_id: str) -> None:
        self._probes.drop(request_id)     # before the final goes out (cancel_probes.py)
        with self._count_lock:
            self._in_flight -= 1

    def _end_open(self, reason: str, message: str) -> None:
        """Every submission still open gets its final here; none is accepted after this."""
        with self._count_lock:
            if self._dead is None:
                self._dead = message
            open_subs = list(self._subs.values())
        deliver([RequestOutput(s.request_id, (), "", True, reason, len(s.prompt_ids), 0, 0, message) for s in open_subs],
                self._subs, self._finished)

    def _watch_cancellations(self, poll_s: float) -> None:
        while not self._stopping.wait(poll_s):
            for rid in self._probes.fired():
                self.cancel(rid)

    def _watch_serving(self, serving: Callable[[], bool | None], poll_s: float) -> None:
        """Its own thread: a slow answer must not hold back cancellations. No call after its first no."""
        while not self._stopping.wait(poll_s):
            if safe_call(serving) is False:
                self.drain()
                return


def _exit_code(process: subprocess.Popen) -> int | None:
    deadline = time.monotonic() + 5.0
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return process.returncode

