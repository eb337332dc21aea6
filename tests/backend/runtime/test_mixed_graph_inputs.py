"""CPU-testable pieces of the mixed-step CUDA graphs: the token ladder, MixedInputBuffers (fields,
padding, the prefill work list) and that a padded mixed step through them computes what the eager
ForwardBatch computes (torch reference kernels on the CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.runtime.forward_batch import build_forward_batch
from kvshare.runtime.input_buffers import MixedInputBuffers
from kvshare.runtime.kv_cache import KVCache
from kvshare.runtime.llama import LlamaModel
from kvshare.runtime.mixed_graph_runner import DEFAULT_TOKEN_LADDER, mixed_graph_sizes
from kvshare.runtime.model_config import NAMED_CONFIGS
from kvshare.runtime.weights import random_weights
from kvshare_kernels.prefill_tiles import IDLE

CPU = torch.device("cpu")
PAGE = 4


def test_ladder_is_capped_by_the_bound_and_the_step_budget():
    assert mixed_graph_sizes(1024, 4096) == tuple(t for t in DEFAULT_TOKEN_LADDER if t <= 1024)
    assert mixed_graph_sizes(1024, 300) == (*range(16, 257, 16), 288, 300)
    assert mixed_graph_sizes(0, 4096) == ()


def test_default_graphs_cover_the_step_budget_with_little_padding():
    from kvshare.engine.engine_config import EngineConfig

    c = EngineConfig()
    sizes = mixed_graph_sizes(c.mixed_graph_max_tokens, c.max_step_tokens)
    assert sizes[-1] == c.max_step_tokens              # no step of the budget runs eagerly
    assert all((b - a) / b <= 0.12 for a, b in zip(sizes, sizes[1:]) if a >= 256)   # padding rows, at most


@st.composite
def steps(draw):
    """Chunks of a step: (ids, start, page table, wants logits); decode rows and prompt chunks."""
    chunks = []
    next_page = 0
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 30))
        n = draw(st.sampled_from([1, 1, draw(st.integers(1, 25))]))
        pages = list(range(next_page, next_page + -(-(start + n) // PAGE)))
        next_page += len(pages)
        ids = [draw(st.integers(-3, 200)) for _ in range(n)]      # < 0: a future ref (overlap)
        chunks.append((ids, start, pages, draw(st.booleans())))
    return chunks


@settings(max_examples=60, deadline=None)
@given(steps(), st.integers(0, 9))
def test_fill_matches_the_eager_batch_and_pads(chunks, extra):
    t = sum(len(c[0]) for c in chunks)
    buf = MixedInputBuffers(max_tokens=160, max_chunks=8, pages_per_seq=16, page_size=PAGE, per_tile=4, device=CPU)
    assert buf.fits(chunks)
    tokens = min(160, t + extra)
    buf.fill(chunks, tokens)
    got = buf.forward_batch(tokens, max_context=64)
    want = build_forward_batch(chunks, PAGE, CPU)
    n, s = len(chunks), want.logits_indices.numel()
    assert got.input_ids[:t].tolist() == want.input_ids.tolist()
    assert got.positions[:t].tolist() == want.positions.tolist()
    assert got.slot_mapping[:t].tolist() == want.slot_mapping.tolist()
    assert got.slot_mapping[t:].tolist() == [-1] * (tokens - t)           # padding writes no KV
    assert got.query_start_loc[:n + 1].tolist() == want.query_start_loc.tolist()
    assert got.query_start_loc[n:].tolist() == [t] * (8 - n + 1)          # later chunks are empty
    assert got.context_lens[:n].tolist() == want.context_lens.tolist() and not got.context_lens[n:].any()
    assert got.logits_indices[:s].tolist() == want.logits_indices.tolist()
    for i, (_, _, pages, _) in enumerate(chunks):
        assert got.page_table[i, :len(pages)].tolist() == list(pages)
    tiles = got.prefill_tiles.numpy()
    assert tiles.shape[0] == buf.tiles_for(tokens)
    live = tiles[tiles[:, 0] != IDLE]
    lens = np.diff(want.query_start_loc.numpy())
    assert sorted(map(tuple, live.tolist())) == sorted((b, m) for b in range(n) for m in range(-(-lens[b] // 4)))


def test_a_step_too_large_for_the_buffers_is_refused():
    buf = MixedInputBuffers(max_tokens=32, max_chunks=2, pages_per_seq=4, page_size=PAGE, per_tile=4, device=CPU)
    assert not buf.fits([([1] * 33, 0, list(range(9)), True)])
    assert not buf.fits([([1], 0, [0], True)] * 3)
    assert not buf.fits([([1] * 8, 0, list(range(5)), True)])             # 5 pages > 4 per sequence
    with pytest.raises(ValueError, match="does not fit a mixed graph"):
        buf.fill([([1] * 20, 0, list(range(5)), True)], 16)


def test_padded_mixed_step_through_buffers_equals_eager_batch():
    config = NAMED_CONFIGS["tiny-llama"]
    model = LlamaModel(config, random_weights(config, dtype=torch.float32, device=CPU, seed=2), device=CPU,
                       dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (9, 6)]
    tables = [[3, 11, 5, 8], [20, 2, 14]]

    def prefilled() -> KVCache:
        kv = KVCache.allocate(config, num_pages=32, page_size=PAGE, dtype=torch.float32, device=CPU)
        model.forward(build_forward_batch([(p, 0, t, False) for p, t in zip(prompts, tables)], PAGE, CPU), kv)
        return kv

    # two decode rows beside a new prompt's first chunk of 7 tokens (pages 25, 26)
    new = torch.randint(3, 250, (7,), generator=g).tolist()
    chunks = [([p[-1] + 1], len(p), t, True) for p, t in zip(prompts, tables)] + [(new, 0, [25, 26], True)]
    kv_a, kv_b = prefilled(), prefilled()
    eager = model.forward(build_forward_batch(chunks, PAGE, CPU), kv_a)
    before = [t.clone() for t in kv_b.k + kv_b.v]
    buf = MixedInputBuffers(max_tokens=32, max_chunks=4, pages_per_seq=8, page_size=PAGE, per_tile=4, device=CPU)
    buf.fill(chunks, 16)                                   # 9 live tokens + 7 padding rows
    padded = model.forward(buf.forward_batch(16, max_context=32), kv_b)
    torch.testing.assert_close(padded[:3], eager)
    for old, new_t, ref in zip(before, kv_b.k + kv_b.v, kv_a.k + kv_a.v):
        torch.testing.assert_close(new_t, ref)              # the same KV written, none by the padding
    assert sum(int((o != x).any()) for o, x in zip(before, kv_b.k + kv_b.v)) > 0
