"""build_forward_batch (vectorised, packed into two host blocks) against a per-token reference."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.runtime.forward_batch import build_forward_batch

PAGE = 4
CPU = torch.device("cpu")


def reference(chunks, page_size):
    """The fields one token at a time, as the first implementation built them."""
    ids, positions, slots, qsl, ctx, logits = [], [], [], [0], [], []
    for tokens, start, pages, wants in chunks:
        ids.extend(tokens)
        for p in range(start, start + len(tokens)):
            positions.append(p)
            slots.append(pages[p // page_size] * page_size + p % page_size)
        qsl.append(qsl[-1] + len(tokens))
        ctx.append(start + len(tokens))
        if wants:
            logits.append(qsl[-1] - 1)
    width = 16 * -(-max(len(pages) for _, _, pages, _ in chunks) // 16)   # one stride class for the kernels
    table = [list(pages) + [0] * (width - len(pages)) for _, _, pages, _ in chunks]
    return ids, positions, slots, qsl, ctx, logits, table


@st.composite
def chunk_lists(draw):
    chunks, next_page = [], 1
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 20))
        n = draw(st.integers(1, 9))
        pages = list(range(next_page, next_page + -(-(start + n) // PAGE)))
        next_page += len(pages) + draw(st.integers(0, 3))
        tokens = draw(st.lists(st.integers(-3, 50_000), min_size=n, max_size=n))   # < 0: overlap's future refs
        chunks.append((tokens, start, tuple(pages), draw(st.booleans())))
    return chunks


@settings(max_examples=200, deadline=None)
@given(chunk_lists())
def test_fields_equal_the_per_token_reference(chunks):
    b = build_forward_batch(chunks, PAGE, CPU, decode_max_context=64)
    ids, positions, slots, qsl, ctx, logits, table = reference(chunks, PAGE)
    assert b.input_ids.tolist() == ids and b.input_ids.dtype == torch.int64
    assert b.positions.tolist() == positions
    assert b.slot_mapping.tolist() == slots and b.slot_mapping.dtype == torch.int32
    assert b.query_start_loc.tolist() == qsl and b.context_lens.tolist() == ctx
    assert b.logits_indices.tolist() == logits and b.logits_indices.dtype == torch.int64
    assert b.page_table.tolist() == table and b.page_table.dtype == torch.int32
    decode_only = all(len(t) == 1 for t, _, _, _ in chunks)
    assert b.decode_only == decode_only
    assert b.max_query_len == max(len(t) for t, _, _, _ in chunks)
    assert b.max_context == (max(max(ctx), 64) if decode_only else max(ctx))
    for field in (b.input_ids, b.positions, b.slot_mapping, b.page_table, b.query_start_loc, b.context_lens):
        # each field starts 64-byte aligned within its block (device blocks themselves are 256-aligned)
        assert field.is_contiguous() and field.storage_offset() * field.element_size() % 64 == 0


def test_steps_with_a_prefill_chunk_carry_the_prefill_work_list():
    """On CUDA every step with a prefill chunk hands the kernel its work list (the mixed graphs' variant)."""
    from kvshare_kernels.prefill_tiles import IDLE

    chunks = [([5, 6, 7, 8, 9], 0, [2, 3], True), ([4], 9, [1, 0, 6], True)]
    b = build_forward_batch(chunks, 4, torch.device("cpu"), prefill_tile_tokens=4)
    assert (b.prefill_tiles[:, 0] != IDLE).all()
    assert b.prefill_tiles.tolist() == [[0, 0], [0, 1], [1, 0]]          # the grid's order
    decode = build_forward_batch([([4], 9, [1, 0, 6], True)], 4, torch.device("cpu"), prefill_tile_tokens=4)
    assert decode.decode_only and decode.prefill_tiles is None
    assert build_forward_batch(chunks, 4, torch.device("cpu")).prefill_tiles is None
