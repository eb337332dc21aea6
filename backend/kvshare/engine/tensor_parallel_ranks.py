"""The ranks of a tensor-parallel engine: rank 0 is the engine's own process (scheduler, sampler,
StepMirror); ranks 1..N-1 are spawned processes that load the same model, keep their shard and a
page pool of the same page ids, and run runtime.tensor_parallel.serve_follower until rank 0 stops.

Each engine's ranks form a process group of their own (runtime.tensor_parallel.new_process_group),
so one process can hold the rank 0 of several tensor-parallel engines (data parallel x tensor
parallel). Rank r runs on the engine's device + r (cuda:0, cuda:1, ...; every rank on the CPU shares
it), gloo on the CPU and NCCL on CUDA (NCCL_NVLS_ENABLE=0: NVLink multicast stays off on the lent
machines).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import tempfile
from pathlib import Path

import torch

from ..runtime.kv_cache import KVCache
from ..runtime.llama import LlamaModel
from ..runtime.model_runner import ModelRunner
from ..runtime.sampler import Sampler
from ..runtime.tensor_parallel import (StepMirror, TensorParallelGroup, new_process_group, serve_follower, shard_model,
                                       shard_specs)
from ..runtime.weights import LoadedModel, load_model
from .engine_config import EngineConfig
from .model_dtypes import MODEL_DTYPES

_TIMEOUT = datetime.timedelta(minutes=5)      # a rank that died fails the others' collectives, not hangs them


def rank_device(device: str, rank: int) -> torch.device:
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _group(setup: "RankSetup", rank: int, device: torch.device) -> TensorParallelGroup:
    pg = new_process_group(_backend(device), setup.store_path, rank, setup.world_size, _TIMEOUT)
    return TensorParallelGroup(rank, setup.world_size, pg, device if device.type == "cuda" else None)


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """What every rank builds from, decided by rank 0."""
    config: EngineConfig
    world_size: int
    num_pages: int
    host_pages: int
    max_model_len: int
    dtype: str
    store_path: str          # the file store where the ranks meet


def build_rank_model(loaded: LoadedModel, setup: RankSetup, rank: int, group: TensorParallelGroup,
                     device: torch.device, dtype: torch.dtype) -> tuple[LlamaModel, KVCache]:
    """This rank's shard of the model and its page pool (same page count and size on every rank)."""
    spec = shard_specs(loaded.config, setup.world_size)[rank]
    local_config, local_weights = shard_model(loaded.config, loaded.weights, spec)
    kv = KVCache.allocate(local_config, num_pages=setup.num_pages, page_size=setup.config.page_size, dtype=dtype,
                          device=device, host_pages=setup.host_pages)
    return LlamaModel(local_config, local_weights, device=device, dtype=dtype, all_reduce=group.all_reduce), kv


class TensorParallelRanks:
    """Started by rank 0 (LLMEngine); close() stops the followers."""

    def __init__(self, setup: RankSetup, processes: list, group: TensorParallelGroup):
        self.setup, self.group, self._processes = setup, group, processes
        self.mirror = StepMirror(group)
        self._closed = False

    @classmethod
    def start(cls, config: EngineConfig, *, num_pages: int, host_pages: int, max_model_len: int,
              loaded: LoadedModel | None = None) -> "TensorParallelRanks":
        """loaded: on the CPU, rank 0's weights; each follower then gets its shard through shared
        memory instead of loading the model again. On CUDA every rank loads onto its own device."""
        import torch.multiprocessing as mp

        world = config.tensor_parallel_size
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        store = Path(tempfile.mkdtemp(prefix="kvshare-tp-")) / "rendezvous"
        setup = RankSetup(config, world, num_pages, host_pages, max_model_len, config.dtype, str(store))
        ctx = mp.get_context("spawn")     # torch's: CPU tensors in the arguments travel as shared memory
        device = rank_device(config.device, 0)
        shards = [None] * world
        if loaded is not None and device.type == "cpu":
            specs = shard_specs(loaded.config, world)
            shards = [None] + [(*shard_model(loaded.config, loaded.weights, specs[r]), loaded.config.eos_token_ids)
                               for r in range(1, world)]
        processes = [ctx.Process(target=_follower_main, args=(setup, rank, shards[rank]), name=f"kvshare-tp-rank{rank}",
                                 daemon=True) for rank in range(1, world)]
        for p in processes:
            p.start()
        return cls(setup, processes, _group(setup, 0, device))

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.mirror.stop()
        for p in self._processes:
            p.join(timeout)
        self.group.close()
        failed = [p.name for p in self._processes if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"tensor-parallel ranks ended badly: {failed}")


def _follower_main(setup: RankSetup, rank: int, shard: tuple | None = None) -> None:
    """shard: (this rank's config, its weights, the EOS ids), or None to load the model here."""
    config = setup.config
    device = rank_device(config.device, rank)
    if device.type == "cpu":     # the ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // setup.world_size))
    group = _group(setup, rank, device)
    dtype = MODEL_DTYPES[setup.dtype]
    if shard is None:
        loaded = load_model(config.model, dtype=dtype, device=device, seed=config.seed)
        model, kv = build_rank_model(loaded, setup, rank, group, device, dtype)
        eos = loaded.config.eos_token_ids
    else:
        local_config, weights, eos = shard
        kv = KVCache.allocate(local_config, num_pages=setup.num_pages, page_size=config.page_size, dtype=dtype,
                              device=device, host_pages=setup.host_pages)
        model = LlamaModel(local_config, weights, device=device, dtype=dtype, all_reduce=group.all_reduce)
    runner = ModelRunner(model, kv, Sampler(eos, seed=config.seed), device,
                         max_model_len=setup.max_model_len, max_rows=config.max_running)
    try:
        serve_follower(runner, group)
    finally:
        group.close()

