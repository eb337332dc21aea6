"""CUDA graphs for mixed steps: prefill chunks beside decode rows, one graph per token count of a ladder.

    fill(chunks) -> one H2D copy into MixedInputBuffers -> graph[t].replay() -> logits [S, V]

A step of n tokens in up to max_chunks chunks runs the smallest captured size t >= n, its tokens
padded (slot -1: no KV written, in no chunk). Eagerly, a mixed step of a 7B model launches ~300
kernels from Python, and under serving a new prompt joins the running decodes every few steps, so
those steps set the pace (peer-serving beside vllm serve, docs/decisions.md). What made them hard
to capture is the prefill attention's grid, sized from the step's longest chunk; here the kernel
takes a work list of (chunk, query block) built on the host (kvshare_kernels.prefill_tiles), so a
graph's grid depends on t alone. The decode rows of a mixed step go through the prefill attention,
as in an eager mixed step (docs/decisions.md: one attention kernel per mixed step).

The graphs have their own memory pool (the decode graphs' outputs stay valid whatever ran in
between), captured largest first so that the smaller ones reuse its blocks.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from typing import Sequence

import torch

from .cuda_graph_runner import resolve_future_ids, warm_and_capture
from .input_buffers import MixedInputBuffers
from .kv_cache import KVCache
from .llama import LlamaModel

log = logging.getLogger("kvshare.runtime")

# Every 16 tokens up to 256, 32 up to 512, 64 up to 2048, 128 up to 4096 (vLLM captures every 8-16
# up to 512): a step pays for its padding rows in every linear layer, under 12% past 256. Capturing
# the ~64 graphs takes seconds at start-up and shares one memory pool.
DEFAULT_TOKEN_LADDER = (*range(16, 257, 16), *range(288, 513, 32), *range(576, 2049, 64), *range(2176, 4097, 128))

Chunk = tuple[Sequence[int], int, Sequence[int], bool]    # build_forward_batch's (ids, start, page table, wants logits)


def mixed_graph_sizes(max_tokens: int, max_step_tokens: int, ladder: Sequence[int] = DEFAULT_TOKEN_LADDER) -> tuple[int, ...]:
    """The ladder up to max_tokens (and a step's token budget), that bound itself on top."""
    top = min(max_tokens, max_step_tokens)
    if top < 1:
        return ()
    return tuple(sorted({t for t in ladder if t < top} | {top}))


class MixedGraphRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, token_sizes: Sequence[int], max_chunks: int, max_context: int,
                 per_tile: int, device: torch.device, future_ids: torch.Tensor | None = None):
        """per_tile: the prefill kernel's query tokens per program (prefill_tiles.tokens_per_tile)."""
        self.model, self.kv, self.max_context, self.future_ids = model, kv, max_context, future_ids
        self.sizes = tuple(sorted(token_sizes))
        self.buffers = MixedInputBuffers(self.sizes[-1], max_chunks, -(-max_context // kv.page_size), kv.page_size,
                                         per_tile, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def _forward(self, tokens: int) -> torch.Tensor:
        batch = self.buffers.forward_batch(tokens, self.max_context)
        if self.future_ids is not None:
            batch = dataclasses.replace(batch, input_ids=resolve_future_ids(batch.input_ids, self.future_ids))
        return self.model.forward(batch, self.kv)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for tokens in reversed(self.sizes):
            # Every row is padding: no KV written or read, no tile.
            self.buffers.fill([], tokens)
            graph, logits = warm_and_capture(lambda: self._forward(tokens), pool, stream)
            self._graphs[tokens] = (graph, logits)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d mixed-step CUDA graphs (tokens %s, up to %d chunks) in %.2f s", len(self._graphs),
                 ",".join(map(str, self.sizes)), self.buffers.max_chunks, self.capture_seconds)

    def size_for(self, chunks: Sequence[Chunk]) -> int | None:
        """The captured token count that holds this step, or None (run it eagerly)."""
        if not self.buffers.fits(chunks):
            return None
        i = bisect.bisect_left(self.sizes, sum(len(c[0]) for c in chunks))
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, chunks: Sequence[Chunk], tokens: int, num_sampling: int) -> torch.Tensor:
        """fp32 logits [num_sampling, V] of the chunks that want them, in chunk order (on the device)."""
        self.buffers.fill(chunks, tokens)
        graph, logits = self._graphs[tokens]
        graph.replay()
        return logits[:num_sampling]
