"""CUDA graphs for decode-only steps: one graph per batch size of a ladder, replayed with padding.

    fill(rows) -> one H2D copy into DecodeInputBuffers -> graph[B].replay() -> logits [B, V], argmax [B]

A decode step of n requests runs the smallest captured batch B >= n. Every graph reads the same
persistent buffers and writes its outputs into one memory pool shared by the ladder (captured
largest first, so the smaller graphs reuse the pool). The decode kernel's split count comes from
host-known shapes (batch, heads, max_context), never from context_lens, so it is fixed at capture:
graphs are captured with max_context = the engine's max_model_len, and eager decode steps use the
same bound so that both paths run identical kernels (kvshare_kernels.decode_attention splits each
request's own context, so any split count is exact; it only changes speed).

With ``cascade_min_batch`` set, each batch size from it up also gets a *cascade* graph: the same
forward with cascade decode attention over a graph-resident plan (CascadePlanBuffers, padded to
the batch and to max_groups(batch) empty-capable groups, a fixed prefix split-K). A step whose rows
share prefix pages fills that plan and replays it; empty groups' programs return at once.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from typing import Sequence

import torch

from .input_buffers import CascadePlanBuffers, DecodeInputBuffers
from .kv_cache import KVCache
from .llama import LlamaModel

log = logging.getLogger("kvshare.runtime")

DEFAULT_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def graph_batch_sizes(max_running: int, ladder: Sequence[int] = DEFAULT_LADDER) -> tuple[int, ...]:
    """The ladder capped by max_running, with max_running itself on top when it is within the ladder."""
    if max_running < 1:
        return ()
    top = min(max_running, max(ladder))
    return tuple(sorted({b for b in ladder if b < top} | {top}))


def kernel_debug() -> bool:
    """KVSHARE_KERNEL_DEBUG reads page tables back to the host (a sync): no graph can be captured."""
    from kvshare_kernels.checks import debug_enabled

    return debug_enabled(None)


def resolve_future_ids(input_ids: torch.Tensor, future_ids: torch.Tensor) -> torch.Tensor:
    """Overlap scheduling: an input id -1 - r stands for future_ids[r] (the previous step's sampled id,
    still on the device); other ids pass through. No host sync, so it also runs inside a graph."""
    rows = (-1 - input_ids).clamp_(min=0)
    return torch.where(input_ids < 0, future_ids.index_select(0, rows.long()), input_ids.long())


def warm_and_capture(forward, pool, stream: torch.cuda.Stream):
    """(graph, forward()'s output captured in it): forward runs once outside the graph first, on
    ``stream`` (Triton compiles the shape's kernels, cuBLAS picks its algorithms), then is captured
    into ``pool``."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def pick_batch_size(sizes: Sequence[int], n: int) -> int | None:
    """The smallest captured batch that holds n rows, or None (run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if n > 0 and i < len(sizes) else None


class CudaGraphRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, batch_sizes: Sequence[int], max_context: int,
                 device: torch.device, future_ids: torch.Tensor | None = None, *,
                 cascade_min_batch: int | None = None, cascade_members: int = 16):
        self.model, self.kv, self.max_context = model, kv, max_context
        self.future_ids = future_ids      # read by the graphs for future_ref inputs (overlap scheduling)
        self.sizes = tuple(sorted(batch_sizes))
        pages_per_seq = -(-max_context // kv.page_size)
        self.buffers = DecodeInputBuffers(self.sizes[-1], pages_per_seq, kv.page_size, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._cascade_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.cascade_plans: CascadePlanBuffers | None = None
        if cascade_min_batch is not None:
            from kvshare_kernels.cascade_decode import graph_prefix_splits

            c, elem = model.config, kv.k[0].element_size()
            sizes = [b for b in self.sizes if b >= cascade_min_batch]
            splits = {b: graph_prefix_splits(b, c.num_heads, c.num_kv_heads, cascade_members, max_context, elem, device)
                      for b in sizes}
            self.cascade_plans = CascadePlanBuffers(sizes, kv.page_size, cascade_members, max_context, splits, device)
        self.capture_seconds = 0.0

    def _forward(self, batch_size: int, cascade: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.buffers.forward_batch(batch_size, self.max_context)
        if cascade:
            batch = dataclasses.replace(batch, cascade=self.cascade_plans.plan(batch_size))
        if self.future_ids is not None:
            batch = dataclasses.replace(batch, input_ids=resolve_future_ids(batch.input_ids, self.future_ids))
        logits = self.model.forward(batch, self.kv)
        return logits, logits.argmax(dim=-1)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bs in reversed(self.sizes):
            self._graphs[bs] = self._capture_one(bs, False, pool, stream)
            if self.cascade_plans is not None and self.cascade_plans.covers(bs):
                self._cascade_graphs[bs] = self._capture_one(bs, True, pool, stream)
        cascade_sizes = sorted(self._cascade_graphs)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs (batch %s; cascade at %s), max_context %d, in %.2f s",
                 len(self._graphs) + len(self._cascade_graphs), ",".join(map(str, self.sizes)),
                 ",".join(map(str, cascade_sizes)) or "none", self.max_context, self.capture_seconds)

    def _capture_one(self, bs: int, cascade: bool, pool, stream: torch.cuda.Stream):
        # The buffers hold padding rows only: slot -1 writes no KV, context 0 reads none; a cascade
        # plan holds empty groups only.
        graph, (logits, ids) = warm_and_capture(lambda: self._forward(bs, cascade), pool, stream)
        return graph, logits, ids

    def batch_for(self, n: int) -> int | None:
        return pick_batch_size(self.sizes, n)

    def has_cascade_graph(self, n: int) -> bool:
        """Whether a decode batch of n rows has a cascade graph (the batch size it would replay)."""
        bs = pick_batch_size(self.sizes, n)
        return bs is not None and bs in self._cascade_graphs

    def run(self, rows: Sequence[tuple[int, int, Sequence[int]]], plan=None) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: (token id, position, page table) -> (fp32 logits [n, V], greedy ids [n]) on the device.

        plan: a host CascadePlan of these rows (plan_cascade's): replays the batch's cascade graph."""
        n = len(rows)
        bs = pick_batch_size(self.sizes, n)
        if bs is None:
            raise ValueError(f"no CUDA graph holds a decode batch of {n}")
        if plan is not None and bs not in self._cascade_graphs:
            raise ValueError(f"no cascade CUDA graph holds a decode batch of {n}")
        self.buffers.fill(rows, bs)
        if plan is not None:
            self.cascade_plans.fill(plan, bs)
        graph, logits, ids = (self._cascade_graphs if plan is not None else self._graphs)[bs]
        graph.replay()
        return logits[:n], ids[:n]
