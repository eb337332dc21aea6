"""Runs one engine step on the model: page copies, the forward over the paged cache, sampling."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

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
    def __init__(self, model: LlamaModel, kv: KVCache, sampler: Sampler, device: torch.device):
        self.model, self.kv, self.sampler, self.device = model, kv, sampler, device

    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int32, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int32, device=self.device)
        self.model.ops.copy_pages(list(self.kv.k), list(self.kv.v), src, dst)

    def execute(self, chunks: Sequence[ChunkInput]) -> list[int]:
        """Returns one sampled token per chunk that has ``sampling``, in chunk order."""
        batch = build_forward_batch(
            [(list(c.token_ids), c.start, list(c.page_table), c.sampling is not None) for c in chunks],
            self.kv.page_size, self.device)
        logits = self.model.forward(batch, self.kv)
        rows = [c.sampling for c in chunks if c.sampling is not None]
        return self.sampler(logits, rows) if rows else []
