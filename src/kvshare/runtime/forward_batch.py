"""The tensors one forward step needs: flattened tokens of every scheduled chunk plus paging info."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvshare_kernels.cascade_decode import CascadePlan


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor        # int64 or int32 [T] the tokens whose KV this step computes
    positions: torch.Tensor        # int64 or int32 [T] their absolute positions
    slot_mapping: torch.Tensor     # int32 [T] where each token's K/V goes in the pool
    page_table: torch.Tensor       # int32 [B, P] per chunk's sequence, padded
    query_start_loc: torch.Tensor  # int32 [B+1] chunk b owns tokens [qsl[b], qsl[b+1])
    context_lens: torch.Tensor     # int32 [B] tokens in the cache after this step
    logits_indices: torch.Tensor   # int64 [S] rows of T whose next-token logits are wanted
    decode_only: bool              # every chunk is one token: the decode kernel applies
    max_query_len: int
    max_context: int
    cascade: "CascadePlan | None" = None   # decode only: rows sharing prefix pages read them once per group

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_forward_batch(chunks: list[tuple[list[int], int, list[int], bool]], page_size: int,
                        device: torch.device, *, decode_max_context: int | None = None,
                        cascade: "CascadePlan | None" = None) -> ForwardBatch:
    """chunks: (token ids to compute, start position, the sequence's page table, wants logits).

    decode_max_context: for a decode-only batch, the bound handed to the decode kernel's split-K
    heuristic instead of the batch's own longest context (CUDA graphs fix it; see cuda_graph_runner).
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    ctx: list[int] = []
    logits_rows: list[int] = []
    max_pages = max((len(pt) for _, _, pt, _ in chunks), default=1)
    table: list[list[int]] = []
    for tokens, start, pages, wants_logits in chunks:
        n = len(tokens)
        ids.extend(tokens)
        for p in range(start, start + n):
            positions.append(p)
            slots.append(pages[p // page_size] * page_size + p % page_size)
        qsl.append(qsl[-1] + n)
        ctx.append(start + n)
        if wants_logits:
            logits_rows.append(qsl[-1] - 1)
        table.append(list(pages) + [0] * (max_pages - len(pages)))
    i32 = dict(dtype=torch.int32, device=device)
    decode_only = all(len(t) == 1 for t, _, _, _ in chunks)
    max_context = max(ctx, default=0)
    if decode_only and decode_max_context is not None:
        max_context = max(max_context, decode_max_context)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, **i32),
        page_table=torch.tensor(table, **i32).reshape(len(chunks), max_pages),
        query_start_loc=torch.tensor(qsl, **i32),
        context_lens=torch.tensor(ctx, **i32),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        decode_only=decode_only,
        max_query_len=max((len(t) for t, _, _, _ in chunks), default=0),
        max_context=max_context,
        cascade=cascade if decode_only else None,
    )
