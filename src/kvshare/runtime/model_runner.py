"""Runs one engine step on the model: page copies, the forward over the paged cache, sampling.

Decode-only steps replay a CUDA graph when one is captured (CudaGraphRunner); prefill and mixed
steps, and every step on the CPU, run the forward eagerly from a ForwardBatch built on the host.
A decode step whose rows share many prefix pages runs eagerly with cascade attention instead
(cascade_planner: the shared pages are read once per group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .cascade_planner import CascadePolicy, plan_shared_prefixes
from .cuda_graph_runner import CudaGraphRunner
from .forward_batch import build_forward_batch
from .kv_cache import KVCache
from .llama import LlamaModel
from .sampler import Sampler, SamplingRow


@dataclass(frozen=True)
class ChunkInput:
    token_ids: Sequence[int]           # tokens whose KV this step computes
    start: int                         # position of token_ids[0]
    page_table: Sequence[int]          # the sequence's physical pages, in order
    sampling: SamplingRow | None       # set when a next token is wanted after this chunk


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, sampler: Sampler, device: torch.device, *,
                 max_model_len: int | None = None, graph_batch_sizes: Sequence[int] = (),
                 cascade: CascadePolicy | None = None):
        self.model, self.kv, self.sampler, self.device = model, kv, sampler, device
        self.cascade = cascade        # None: every decode reads each row's pages itself
        k0 = kv.k[0]
        self._kv_bytes_per_token = 2 * len(kv.k) * k0[0, 0].numel() * k0.element_size()
        # Decode steps size the kernel's split-K from this bound (graphs must fix it at capture); eager
        # decodes on CUDA use it too, so graphs on and off run the same kernels.
        self.decode_context = max_model_len or model.config.max_position
        self.graphs: CudaGraphRunner | None = None
        if device.type == "cuda" and graph_batch_sizes:
            self.graphs = CudaGraphRunner(model, kv, graph_batch_sizes, self.decode_context, device)
            self.graphs.capture()

    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int32, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int32, device=self.device)
        self.model.ops.copy_pages(list(self.kv.k), list(self.kv.v), src, dst)

    def execute(self, chunks: Sequence[ChunkInput]) -> list[int]:
        """Returns one sampled token per chunk that has ``sampling``, in chunk order."""
        rows = [c.sampling for c in chunks if c.sampling is not None]
        plan = None
        if self.cascade is not None and all(len(c.token_ids) == 1 for c in chunks):
            plan = plan_shared_prefixes([(c.page_table, c.start + 1) for c in chunks], self.kv.page_size,
                                        self.device, self.cascade, self._kv_bytes_per_token)
        if plan is None and self._graph_fits(chunks, len(rows)):
            logits, greedy = self.graphs.run([(c.token_ids[0], c.start, c.page_table) for c in chunks])
            return self.sampler(logits, rows, greedy_ids=greedy)
        decode_bound = self.decode_context if self.device.type == "cuda" else None
        batch = build_forward_batch(
            [(list(c.token_ids), c.start, list(c.page_table), c.sampling is not None) for c in chunks],
            self.kv.page_size, self.device, decode_max_context=decode_bound, cascade=plan)
        logits = self.model.forward(batch, self.kv)
        return self.sampler(logits, rows) if rows else []

    def _graph_fits(self, chunks: Sequence[ChunkInput], num_sampling: int) -> bool:
        g = self.graphs
        if g is None or num_sampling != len(chunks) or g.batch_for(len(chunks)) is None:
            return False
        fits = g.buffers.fits
        return all(fits(c.token_ids, c.page_table) for c in chunks)
