"""The tensors one forward step needs: flattened tokens of every scheduled chunk plus paging info."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
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
    decode_only: bool              # every chunk is one token (and no prompt's, on request): the decode kernel applies
    max_query_len: int
    max_context: int
    cascade: "CascadePlan | None" = None   # decode only: rows sharing prefix pages read them once per group
    # int32 [N, 2] the prefill kernel's work list (kvshare_kernels.prefill_tiles), set on CUDA for steps
    # with a prefill chunk (eager and in the mixed-step graphs, whose rows past the last chunk's are
    # padding); None: the kernel's own grid
    prefill_tiles: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_forward_batch(chunks: list[tuple[Sequence[int], int, Sequence[int], bool]], page_size: int,
                        device: torch.device, *, decode_max_context: int | None = None,
                        cascade: "CascadePlan | None" = None, all_logits: Sequence[bool] | None = None,
                        prompt_prefill: bool = False, prefill_tile_tokens: int | None = None) -> ForwardBatch:
    """chunks: (token ids to compute, start position, the sequence's page table, wants logits).

    all_logits: per chunk, whether every one of its tokens' logits is wanted (return_context_logits),
    not only its last's; those rows come in token order, in chunk order with the others.

    prompt_prefill: the step holds a chunk of prompt tokens, which then goes through the prefill
    attention even as a single token (a prompt's tail after a prefix-cache hit), so that a prompt's
    row is computed the same way whatever its chunk's length (runtime/cpu_attention.py).

    prefill_tile_tokens: the prefill kernel's query tokens per program (kvshare_kernels.prefill_tiles;
    CUDA): a step that is not decode-only gets the kernel's work list, as the mixed-step graphs do,
    so eager and captured steps run one kernel variant (and no first long prompt compiles another).

    decode_max_context: for a decode-only batch, the bound handed to the decode kernel's split-K
    heuristic instead of the batch's own longest context (CUDA graphs fix it; see cuda_graph_runner).

    The fields are built with numpy into two host blocks (int64, int32) and reach a CUDA device in
    two copies from pinned memory that do not wait for the device: a pageable torch.tensor(...,
    device=cuda) blocks the host until the stream drains, which under overlap scheduling held every
    prefill/mixed step's host work behind the previous step (behind the Triton server on the H200:
    0.84 -> 0.965 of the offline engine once it stopped; docs/results/h200.md).
    """
    host = chunk_arrays(chunks, page_size, all_logits=all_logits)
    b, lens, ctx, (_, max_pages) = len(chunks), host.lens, host.context_lens, host.page_table.shape
    wide = _Packer(np.int64)        # ids, positions, logits rows
    ids_at, pos_at, logits_at = wide.add(host.input_ids), wide.add(host.positions), wide.add(host.logits_rows)
    narrow = _Packer(np.int32)      # slots, query_start_loc, context_lens, page table
    slots_at, qsl_at = narrow.add(host.slots), narrow.add(host.query_start_loc)
    ctx_at, table_at = narrow.add(ctx), narrow.add(host.page_table.ravel())
    decode_only = bool((lens == 1).all()) and not prompt_prefill
    tiles_at = None
    if prefill_tile_tokens is not None and not decode_only:
        from kvshare_kernels.prefill_tiles import plan_tiles

        tiles_at = narrow.add(plan_tiles(lens, ctx, prefill_tile_tokens).ravel())
    w, n = wide.upload(device), narrow.upload(device)
    max_context = int(ctx.max()) if b else 0
    if decode_only and decode_max_context is not None:
        max_context = max(max_context, decode_max_context)
    return ForwardBatch(
        input_ids=w[ids_at], positions=w[pos_at], slot_mapping=n[slots_at],
        page_table=n[table_at].view(b, max_pages), query_start_loc=n[qsl_at], context_lens=n[ctx_at],
        logits_indices=w[logits_at], decode_only=decode_only,
        max_query_len=int(lens.max()) if b else 0, max_context=max_context,
        cascade=cascade if decode_only else None,
        prefill_tiles=None if tiles_at is None else n[tiles_at].view(-1, 2),
    )


_PAGE_TABLE_ALIGN = 16


@dataclass(frozen=True)
class ChunkArrays:
    """A step's chunks as host arrays, the fields of a ForwardBatch before upload."""
    lens: np.ndarray               # int64 [B] tokens per chunk
    input_ids: np.ndarray          # int64 [T]
    positions: np.ndarray          # int64 [T]
    slots: np.ndarray              # int64 [T]
    query_start_loc: np.ndarray    # int64 [B+1]
    context_lens: np.ndarray       # int64 [B]
    page_table: np.ndarray         # int32 [B, width]
    logits_rows: np.ndarray        # int64 [S]


def chunk_arrays(chunks: list[tuple[Sequence[int], int, Sequence[int], bool]], page_size: int, *,
                 all_logits: Sequence[bool] | None = None, table_width: int | None = None) -> ChunkArrays:
    """build_forward_batch's chunks as host arrays; the page table is table_width wide (default:
    the longest table rounded up to _PAGE_TABLE_ALIGN)."""
    b = len(chunks)
    lens = np.fromiter((len(t) for t, _, _, _ in chunks), dtype=np.int64, count=b)
    starts = np.fromiter((s for _, s, _, _ in chunks), dtype=np.int64, count=b)
    wants = np.fromiter((w for _, _, _, w in chunks), dtype=bool, count=b)
    t = int(lens.sum())
    if table_width is None:
        # The page table's row stride is a kernel argument, and Triton compiles one variant per class
        # of it (== 1, divisible by 16, other): rounding the width up to 16 keeps every step in one
        # class, so a new context length never triggers a compile mid-serving (unread columns cost nothing).
        longest = max((len(pt) for _, _, pt, _ in chunks), default=1)
        table_width = _PAGE_TABLE_ALIGN * max(1, -(-longest // _PAGE_TABLE_ALIGN))
    qsl = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    table = np.zeros((b, table_width), dtype=np.int32)
    for i, (_, _, pages, _) in enumerate(chunks):
        table[i, :len(pages)] = pages
    row = np.repeat(np.arange(b), lens)
    positions = np.arange(t, dtype=np.int64) - np.repeat(qsl[:-1] - starts, lens)
    slots = table[row, positions // page_size].astype(np.int64) * page_size + positions % page_size
    logits_rows = qsl[1:][wants] - 1
    if all_logits is not None and any(all_logits):
        logits_rows = np.concatenate([np.arange(qsl[i], qsl[i + 1]) if all_logits[i] else qsl[i + 1:i + 2] - 1
                                      for i in range(b) if all_logits[i] or wants[i]]).astype(np.int64)
    ids = np.fromiter(itertools.chain.from_iterable(tok for tok, _, _, _ in chunks), dtype=np.int64, count=t)
    return ChunkArrays(lens, ids, positions, slots, qsl, starts + lens, table, logits_rows)


class _Packer:
    """Arrays of one dtype laid end to end in one host block (each start 16-element aligned, so the
    kernels see the pointer alignment they were specialised for), uploaded in one copy."""
    _ALIGN = 16

    def __init__(self, dtype: type):
        self.dtype, self.parts, self.size = dtype, [], 0

    def add(self, values: np.ndarray) -> slice:
        at = slice(self.size, self.size + len(values))
        self.parts.append((at.start, values))
        self.size += -(-len(values) // self._ALIGN) * self._ALIGN
        return at

    def upload(self, device: torch.device) -> torch.Tensor:
        host = np.zeros(max(self.size, 1), dtype=self.dtype)
        for start, values in self.parts:
            host[start:start + len(values)] = values
        return to_device(torch.from_numpy(host), device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: on CUDA through pinned memory
    (the caching host allocator keeps the pinned block until the copy has run)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host if device.type == "cpu" else host.to(device)
