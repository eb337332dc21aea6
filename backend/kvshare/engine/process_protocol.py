"""The messages between the Triton stub and its engine process (engine/engine_process.py), pickled
over one socket pair. Frozen data only: no callable crosses the boundary; sinks and the clients'
cancellation probes stay on the stub's side.

    stub ──► engine process   StartEngines, then Submit / Cancel / Drain, and Shutdown last
    engine process ──► stub   EnginesReady (or StartFailed), then Outputs / Tick / Routed, Closed last
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ..core.router import RouteDecision
from ..runtime.step_threads import StepThreads
from ..sampling_params import SamplingParams
from .data_parallel import EngineTick, ParallelConfig
from .engine_config import EngineConfig
from .limits import EngineLimits
from .outputs import RequestOutput


@dataclass(frozen=True)
class StartEngines:
    config: EngineConfig
    parallel: ParallelConfig
    step_threads: StepThreads | None      # CPU engines: torch threads per step kind


@dataclass(frozen=True)
class EnginesReady:
    pid: int
    config: EngineConfig                  # engine 0's, as built (tensor parallelism may change it)
    limits: EngineLimits
    tokenizer: Any                        # pickled copy: the stub tokenizes stop and bad words with it
    num_pages: int
    page_size: int
    devices: tuple[str, ...]


@dataclass(frozen=True)
class StartFailed:
    error: str                            # the traceback, for the model's load error


@dataclass(frozen=True)
class RemoteRequest:
    """A Submission without its callables."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str
    echo_prompt: bool
    fork_of: str | None
    timeout_s: float | None


@dataclass(frozen=True)
class Submit:
    route_id: str
    requests: tuple[RemoteRequest, ...]   # all members of one Triton request: one engine takes them all


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Drain:
    """The server no longer serves the model: end every request in flight."""


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Outputs:
    outputs: list[RequestOutput]          # one engine step's


@dataclass(frozen=True)
class Tick:
    tick: EngineTick


@dataclass(frozen=True)
class Routed:
    decision: RouteDecision


@dataclass(frozen=True)
class Closed:
    """The engines are closed (disk writes landed) and every request has had its final output."""


def send(conn: Connection, message) -> None:
    """Plain pickle, not Connection.send's: torch registers reducers with multiprocessing's pickler
    that would share a tensor's storage through a file descriptor; the logits in outputs travel as
    bytes (they are small, and asked for rarely)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())
