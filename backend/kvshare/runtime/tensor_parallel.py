"""Tensor parallelism, Megatron-style, on torch.distributed (gloo on the CPU, NCCL on CUDA).

Each rank holds a contiguous group of KV heads with their query heads (the QKV rows and the
o_proj columns of those heads) and a slice of the MLP's intermediate columns (gate/up rows, down
columns); embedding, norms and lm_head are replicated. One all-reduce per block half (after o_proj,
after down) gives every rank the same residual stream:

    x ─► qkv[rank's heads] ─► attention over rank's KV pages ─► o_proj[:, rank's heads] ─► all-reduce
      ─► gate_up[rank's columns] ─► silu·mul ─► down[:, rank's columns] ─► all-reduce

The page pool is per rank (its own KV heads) with identical page ids: the scheduler runs once, on
rank 0, whose ModelRunner hands every page move and forward batch to the other ranks through
StepMirror (a broadcast) before running it itself; the followers (serve_follower) run the same
operations in the same order, so their collectives pair up. Only rank 0 samples.

Heads are split by KV-head groups, as evenly as the count allows: SmolLM2-135M's 3 KV heads (9
query heads) over 2 ranks give 2 + 1; Llama-2-7B's 32 and Llama-3-8B's 8 split evenly over 2, 4, 8.
"""
from __future__ import annotations

import dataclasses
import datetime
import pickle
from dataclasses import dataclass

import torch

from .model_config import ModelConfig
from .weights import LayerWeights, LlamaWeights


@dataclass(frozen=True)
class ShardSpec:
    rank: int
    world_size: int
    kv_heads: tuple[int, int]        # [start, end) of the model's KV heads
    q_heads: tuple[int, int]         # [start, end) of its query heads (the KV heads' groups)
    intermediate: tuple[int, int]    # [start, end) of the MLP's intermediate columns


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """n items into `parts` contiguous ranges, the first n % parts one longer."""
    base, extra = divmod(n, parts)
    out, at = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append((at, at + size))
        at += size
    return out


def shard_specs(config: ModelConfig, world_size: int) -> tuple[ShardSpec, ...]:
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if world_size > config.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds the model's {config.num_kv_heads} KV heads "
                         "(heads are split by KV-head groups)")
    group = config.num_heads // config.num_kv_heads
    kv = _split(config.num_kv_heads, world_size)
    mlp = _split(config.intermediate_size, world_size)
    return tuple(ShardSpec(r, world_size, kv[r], (kv[r][0] * group, kv[r][1] * group), mlp[r])
                 for r in range(world_size))


def shard_model(config: ModelConfig, weights: LlamaWeights, spec: ShardSpec) -> tuple[ModelConfig, LlamaWeights]:
    """This rank's shape and weights (views of the full tensors made contiguous; replicated ones shared)."""
    d, hq, hkv, inter = config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    (k0, k1), (q0, q1), (i0, i1) = spec.kv_heads, spec.q_heads, spec.intermediate
    rows = torch.cat([torch.arange(q0 * d, q1 * d), hq * d + torch.arange(k0 * d, k1 * d),
                      (hq + hkv) * d + torch.arange(k0 * d, k1 * d)])
    gate_up_rows = torch.cat([torch.arange(i0, i1), inter + torch.arange(i0, i1)])

    def layer(lw: LayerWeights) -> LayerWeights:
        r = rows.to(lw.qkv.device)
        return dataclasses.replace(
            lw, qkv=lw.qkv.index_select(0, r).contiguous(),
            qkv_bias=None if lw.qkv_bias is None else lw.qkv_bias.index_select(0, r).contiguous(),
            o_proj=lw.o_proj[:, q0 * d:q1 * d].contiguous(),
            gate_up=lw.gate_up.index_select(0, gate_up_rows.to(lw.gate_up.device)).contiguous(),
            down=lw.down[:, i0:i1].contiguous())

    local = dataclasses.replace(config, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0)
    return local, dataclasses.replace(weights, layers=tuple(layer(lw) for lw in weights.layers))


class TensorParallelGroup:
    """One tensor-parallel engine's ranks: the block halves' all-reduce and the step broadcast from
    rank 0, on a process group of their own (not torch.distributed's default group), so that one
    process can drive several tensor-parallel engines (data parallel x tensor parallel)."""

    def __init__(self, rank: int, world_size: int, process_group=None, device: torch.device | None = None):
        self.rank, self.world_size = rank, world_size
        self._pg = process_group
        # Messages travel as bytes in a tensor where the backend can send them (the CPU for gloo,
        # the rank's GPU for NCCL).
        self._device = device if device is not None else torch.device("cpu")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._pg.allreduce([t]).wait()
        return t

    def broadcast(self, message: object = None) -> object:
        """Rank 0's message, on every rank (rank 0 passes it, the others receive it)."""
        if self.rank == 0:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
            self._pg.broadcast(size, 0).wait()
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)
            self._pg.broadcast(payload, 0).wait()
            return message
        size = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._pg.broadcast(size, 0).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self._device)
        self._pg.broadcast(payload, 0).wait()
        return pickle.loads(payload.cpu().numpy().tobytes())

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self._pg = None


def new_process_group(backend: str, store_path: str, rank: int, world_size: int,
                      timeout: datetime.timedelta):
    """A process group of world_size ranks that meet at a file store, outside torch.distributed's
    default group (which admits one group per process)."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, world_size)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"unknown torch.distributed backend {backend!r}")


class StepMirror:
    """Rank 0's side: each page move and forward batch goes to the followers before rank 0 runs it.

    The message is pickled (a ForwardBatch of host tensors on the CPU): a per-step allocation, fine
    for gloo on the CPU; on CUDA the batch's fields should go as one packed device tensor per step
    (docs/develop/engine.md, GPU later).
    """

    def __init__(self, group: TensorParallelGroup):
        self.group = group

    def __call__(self, kind: str, payload: object) -> None:
        self.group.broadcast((kind, payload))

    def stop(self) -> None:
        self.group.broadcast(("stop", None))


def serve_follower(runner, group: TensorParallelGroup) -> int:
    """A follower rank's loop: run what rank 0 mirrors, in order, until it says stop. Returns the
    number of forwards run. runner: this rank's ModelRunner (its own shard and page pool)."""
    forwards = 0
    while True:
        kind, payload = group.broadcast()
        if kind == "stop":
            return forwards
        if kind == "copy":
            runner.copy_pages(payload)
        elif kind == "transfer":
            runner.transfer_pages(*payload)
        elif kind == "forward":
            runner.model.forward(payload, runner.kv)
            forwards += 1
        else:
            raise ValueError(f"unknown tensor-parallel step message {kind!r}")
