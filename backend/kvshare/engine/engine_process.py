"""The engine process: the engines, their loops and the router, apart from the Triton stub.

    python -m kvshare.engine.engine_process FD        (started by engine/process_group.py)

In one process the engine thread and the stub's response pump share one GIL: at batch 64 on the
H200 the pump's ~50 µs of GIL-held CPU per response (building pb_utils tensors, `send`) came on top
of the engine's own host work, and a 6.1 ms decode step became a 10.2 ms inter-token latency. Here
the engine thread has a GIL of its own; the stub keeps the pump, the probes and Triton's IPC, and
gets one message per step (the step's outputs). vLLM splits its engine core from its API server
for the same reason.

The process serves its parent until the parent says Shutdown or goes away (the socket reads EOF: a
killed stub leaves no engine behind). Either way every request in flight gets its final output
(cancelled) and the engines close, so disk-tier writes in flight land.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from multiprocessing.connection import Connection

from .data_parallel import EngineGroup, EngineTick, build_engines
from .engine import LLMEngine
from .engine_loop import Submission
from .faults import FaultInjector
from .gc_tuning import freeze_startup_heap
from .process_protocol import (Cancel, Closed, Drain, EnginesReady, Outputs, Routed, Shutdown, StartEngines,
                               StartFailed, Submit, Tick, recv, send)

log = logging.getLogger("kvshare.engine")


class _Outbox:
    """Sends to the stub from the engine threads and this main thread alike; a stub that is gone
    makes every later send a no-op (the main thread sees the EOF and shuts down)."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._lock = threading.Lock()
        self._broken = False

    def send(self, message) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                send(self._conn, message)
            except (OSError, EOFError):
                self._broken = True

    def outputs(self, outputs) -> None:
        self.send(Outputs(outputs))


def build(start: StartEngines, faults: FaultInjector | None) -> list[LLMEngine]:
    if start.step_threads is not None:
        import torch

        torch.set_num_threads(start.step_threads.decode)
    if start.parallel.data_parallel_size > 1:
        return build_engines(start.config, start.parallel, faults=faults)
    return [LLMEngine(start.config, faults=faults, step_threads=start.step_threads)]


def serve(conn: Connection) -> int:
    start = recv(conn)
    if not isinstance(start, StartEngines):
        raise TypeError(f"the engine process expects StartEngines first, got {type(start).__name__}")
    outbox = _Outbox(conn)
    faults = FaultInjector.from_environment(os.environ)
    try:
        engines = build(start, faults)
    except BaseException:
        outbox.send(StartFailed(traceback.format_exc()))
        return 1
    many = len(engines) > 1
    group = EngineGroup(engines, start.parallel.router_settings, max_in_flight=None, faults=faults,
                        on_tick=lambda tick: outbox.send(Tick(tick)),
                        on_route=(lambda decision: outbox.send(Routed(decision))) if many else None)
    first = engines[0]
    freeze_startup_heap()
    outbox.send(EnginesReady(os.getpid(), first.config, first.limits, first.tokenizer, first.kv.num_pages,
                             first.kv.page_size, tuple(str(e.device) for e in engines)))
    for i, engine in enumerate(engines):        # the gauges read right before the first request
        outbox.send(Tick(EngineTick.of(i, engine)))
    try:
        _serve_requests(conn, group, outbox)
    finally:
        group.shutdown()         # every request in flight ends (cancelled); disk writes land
        outbox.send(Closed())
    return 0


def _serve_requests(conn: Connection, group: EngineGroup, outbox: _Outbox) -> None:
    while True:
        try:
            message = recv(conn)
        except (EOFError, OSError):
            log.warning("the Triton stub is gone: the engine process stops")
            return
        if isinstance(message, Submit):
            subs = [Submission(r.request_id, r.prompt_ids, r.params, r.cache_salt, r.echo_prompt, None, None,
                               batch_sink=outbox.outputs, fork_of=r.fork_of, timeout_s=r.timeout_s)
                    for r in message.requests]
            # Admission is the stub's (it answers execute() at once): nothing is refused here.
            group.try_submit_all(message.route_id, subs)
        elif isinstance(message, Cancel):
            group.cancel(message.request_id)
        elif isinstance(message, Drain):
            group.drain()
        elif isinstance(message, Shutdown):
            return
        else:
            log.error("the engine process got an unknown message %r; ignored", type(message).__name__)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=os.environ.get("KVSHARE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s[engine process]: %(message)s")
    import faulthandler
    import signal

    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    # Ctrl-C in a terminal reaches the whole process group: the stub decides when this process stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return serve(Connection(int(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
