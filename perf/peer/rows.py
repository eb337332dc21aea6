"""The side-by-side rows: which trace, how many of its requests, how many in flight, on which model.

One table for both sides, so that kvshare's rows (perf/engine/offline_benchmark.py) and vLLM's
(perf/peer/vllm_offline.py) cannot drift apart: the `peer` suite of perf/gpu/suites.py builds both
sides' commands from ROWS. A row's `max_num_seqs` is kvshare's max_running and vLLM's max_num_seqs;
for a closed-loop row it is the trace's own concurrency (the requests kept in flight), for the
open-loop row every request is submitted at once and the engine's batch limit is the request count.

Pure Python (no torch, no vLLM): the CPU tests and the driver's --dry-run import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Iterable, Sequence

# kvshare's named dummy shapes (backend/kvshare/runtime/model_config.py) -> a short tag for stage names.
MODEL_TAGS = {"llama-2-7b": "7b", "llama-3.1-8b": "8b"}
# shared-prefix as the cascade suite runs it: every request at once, cache-aware admission, a pool
# the size of vLLM's (0.9 of the H200 less the weights), no admission delay.
SHARED_PREFIX_KVSHARE = ("--admission", "cache_aware", "--kv-gb", "100", "--admission-delay", "0")


@dataclass(frozen=True)
class PeerRow:
    workload: str                    # a perf/core/workload_traces.py trace
    requests: int                    # its first N requests
    max_num_seqs: int                # requests in flight (kvshare max_running = vLLM max_num_seqs)
    model: str = "llama-2-7b"
    repeat: int = 3                  # runs per side; the row keeps the run with the median tok/s
    open_loop: bool = False          # every request submitted at once; TTFT then includes queueing
    max_model_len: int | None = None  # None: the model's window
    kvshare_args: tuple[str, ...] = ()   # engine settings of kvshare's side beyond the defaults

    def __post_init__(self) -> None:
        if self.model not in MODEL_TAGS:
            raise ValueError(f"model: {self.model!r} is not one of {sorted(MODEL_TAGS)}")
        if self.requests < 1 or self.max_num_seqs < 1 or self.repeat < 1:
            raise ValueError(f"{self.workload}: requests, max_num_seqs and repeat must be >= 1")
        if self.open_loop and self.max_num_seqs != self.requests:
            raise ValueError(f"{self.workload}: an open-loop row holds every request: max_num_seqs = requests")

    @property
    def engine(self) -> tuple[str, int, int | None]:
        """What one vLLM engine is built for: rows with the same key share it."""
        return self.model, self.max_num_seqs, self.max_model_len

    @property
    def kvshare_process(self) -> tuple:
        """Rows with the same key run in one offline_benchmark process (one model load)."""
        return self.model, self.max_model_len, self.repeat, self.open_loop, self.kvshare_args


ROWS: tuple[PeerRow, ...] = (
    PeerRow("fixed-1", 2, 1),
    PeerRow("seed-12x128", 48, 12),
    PeerRow("seed-long", 24, 12),
    PeerRow("fixed-64", 128, 64),
    PeerRow("fixed-256", 256, 256),
    PeerRow("shared-prefix", 256, 256, repeat=1, open_loop=True, kvshare_args=SHARED_PREFIX_KVSHARE),
    # 8 x (32,768 + 256) tokens: 34.6 GB of KV at 128 KiB a token; kvshare's warm-up caches as much
    # again (its prompts shifted by one), so the pool holds both without evicting.
    PeerRow("seed-long-32k", 8, 8, model="llama-3.1-8b", repeat=1, max_model_len=32_768 + 256,
            kvshare_args=("--kv-gb", "80")),
)
BY_WORKLOAD = {r.workload: r for r in ROWS}


def rows_named(names: Iterable[str]) -> tuple[PeerRow, ...]:
    names = [n for n in names if n]
    unknown = [n for n in names if n not in BY_WORKLOAD]
    if unknown:
        raise ValueError(f"rows: unknown {', '.join(unknown)}; known: {', '.join(BY_WORKLOAD)}")
    return tuple(BY_WORKLOAD[n] for n in names)


def _groups(rows: Sequence[PeerRow], key) -> list[tuple[PeerRow, ...]]:
    """Consecutive rows with the same key, in ROWS order (ROWS keeps each group together)."""
    return [tuple(g) for _, g in groupby(rows, key=key)]


def vllm_engines(rows: Sequence[PeerRow] = ROWS) -> list[tuple[PeerRow, ...]]:
    groups = _groups(rows, lambda r: r.engine)
    if len({g[0].engine for g in groups}) != len(groups):
        raise ValueError("rows of one vLLM engine must stand together in ROWS")
    return groups


def kvshare_processes(rows: Sequence[PeerRow] = ROWS) -> list[tuple[PeerRow, ...]]:
    groups = _groups(rows, lambda r: r.kvshare_process)
    if len({g[0].kvshare_process for g in groups}) != len(groups):
        raise ValueError("rows of one kvshare process must stand together in ROWS")
    return groups


def vllm_stage_name(group: Sequence[PeerRow]) -> str:
    return f"vllm-{MODEL_TAGS[group[0].model]}-c{group[0].max_num_seqs}"


def kvshare_stage_name(group: Sequence[PeerRow]) -> str:
    head = group[0]
    return f"kvshare-{MODEL_TAGS[head.model]}" + ("-open" if head.open_loop else "")


def kvshare_args(group: Sequence[PeerRow]) -> tuple[str, ...]:
    """perf/engine/offline_benchmark.py's arguments for one process's rows (no HF baselines)."""
    head = group[0]
    if any(r.kvshare_process != head.kvshare_process for r in group):
        raise ValueError("rows of one kvshare process need one model, context, repeat count and settings")
    args = ["--model", f"dummy:{head.model}", "--dtype", "float16",
            "--workloads", ",".join(f"{r.workload}:{r.requests}:" for r in group), "--baselines", "",
            "--repeat", str(head.repeat)]
    if head.open_loop:   # every request at once; the batch limit holds them all
        args += ["--open-loop", "--max-running", str(max(r.max_num_seqs for r in group))]
    if head.max_model_len:
        args += ["--max-model-len", str(head.max_model_len)]
    return (*args, *head.kvshare_args)
