"""CPU-testable pieces of the CUDA-graph decode path: the batch-size ladder, the persistent input
buffers (layout, padding, one copy) and that a padded decode through them computes what the eager
ForwardBatch computes (torch reference kernels on the CPU)."""
from __future__ import annotations

import pytest
import torch

from kvshare.runtime.cuda_graph_runner import DEFAULT_LADDER, graph_batch_sizes, pick_batch_size
from kvshare.runtime.forward_batch import build_forward_batch
from kvshare.runtime.input_buffers import DecodeInputBuffers
from kvshare.runtime.kv_cache import KVCache
from kvshare.runtime.llama import LlamaModel
from kvshare.runtime.model_config import NAMED_CONFIGS
from kvshare.runtime.weights import random_weights

CPU = torch.device("cpu")


@pytest.mark.parametrize("max_running,expected", [
    (1, (1,)), (12, (1, 2, 4, 8, 12)), (64, (1, 2, 4, 8, 16, 24, 32, 48, 64)), (256, DEFAULT_LADDER),
    (1000, DEFAULT_LADDER), (0, ()),
])
def test_ladder_is_capped_by_max_running(max_running, expected):
    assert graph_batch_sizes(max_running) == expected


def test_pick_smallest_graph_that_holds_the_batch():
    sizes = graph_batch_sizes(64)
    assert [pick_batch_size(sizes, n) for n in (1, 2, 3, 5, 8, 9, 17, 33, 48, 49, 64)] == \
        [1, 2, 4, 8, 8, 16, 24, 48, 48, 64, 64]
    assert pick_batch_size(sizes, 65) is None and pick_batch_size(sizes, 0) is None


def test_fill_writes_live_rows_pads_and_copies_once():
    buf = DecodeInputBuffers(max_batch=8, pages_per_seq=4, page_size=4, device=CPU)
    rows = [(11, 5, (7, 3)), (12, 0, (9,)), (13, 12, (1, 2, 6, 4))]
    buf.fill(rows, 4)
    assert buf.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buf.positions[:4].tolist() == [5, 0, 12, 0]
    assert buf.slot_mapping[:4].tolist() == [3 * 4 + 1, 9 * 4 + 0, 4 * 4 + 0, -1]
    assert buf.context_lens[:4].tolist() == [6, 1, 13, 0]
    assert buf.page_table[0, :2].tolist() == [7, 3] and buf.page_table[2].tolist() == [1, 2, 6, 4]
    # Rows beyond the graph's batch are untouched padding from start-up.
    assert buf.slot_mapping[4:].tolist() == [-1] * 4 and buf.context_lens[4:].tolist() == [0] * 4
    # A smaller step afterwards re-pads the rows the previous step used.
    buf.fill(rows[:1], 2)
    assert buf.input_ids[:2].tolist() == [11, 0] and buf.slot_mapping[:2].tolist() == [13, -1]
    assert buf.context_lens[:2].tolist() == [6, 0]   # row 2 is outside batch 2: never read
    fb = buf.forward_batch(2, max_context=16)
    assert fb.decode_only and fb.num_tokens == 2 and fb.page_table.shape == (2, 4)
    assert fb.logits_indices.tolist() == [0, 1] and fb.max_context == 16


def test_fill_rejects_a_batch_larger_than_the_graph():
    buf = DecodeInputBuffers(max_batch=4, pages_per_seq=2, page_size=4, device=CPU)
    with pytest.raises(ValueError):
        buf.fill([(1, 0, (0,))] * 3, 2)
    with pytest.raises(ValueError):
        buf.fill([(1, 0, (0,))] * 5, 8)
    assert buf.fits([1], (0, 1)) and not buf.fits([1, 2], (0,)) and not buf.fits([1], (0, 1, 2))


def test_padded_decode_through_buffers_equals_eager_batch():
    config = NAMED_CONFIGS["tiny-llama"]
    weights = random_weights(config, dtype=torch.float32, device=CPU, seed=1)
    model = LlamaModel(config, weights, device=CPU, dtype=torch.float32)
    page_size, num_pages = 4, 32

    def prefilled() -> tuple[KVCache, list[list[int]], list[list[int]]]:
        kv = KVCache.allocate(config, num_pages=num_pages, page_size=page_size, dtype=torch.float32, device=CPU)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 8, 3)]
        tables = [[2, 9, 4], [7, 1, 30], [12, 5]]
        model.forward(build_forward_batch([(p, 0, t, False) for p, t in zip(prompts, tables)], page_size, CPU), kv)
        return kv, prompts, tables

    kv_a, prompts, tables = prefilled()
    eager = model.forward(build_forward_batch([([p[-1] + 1], len(p), t, True) for p, t in zip(prompts, tables)],
                                              page_size, CPU), kv_a)
    kv_b, _, _ = prefilled()
    before = [t.clone() for t in kv_b.k + kv_b.v]
    buf = DecodeInputBuffers(max_batch=8, pages_per_seq=4, page_size=page_size, device=CPU)
    buf.fill([(p[-1] + 1, len(p), t) for p, t in zip(prompts, tables)], 4)   # 3 live rows + 1 padding row
    padded = model.forward(buf.forward_batch(4, max_context=16), kv_b)
    torch.testing.assert_close(padded[:3], eager)
    assert padded[3].isfinite().all()
    live = {t[len(p) // page_size] * page_size + len(p) % page_size for p, t in zip(prompts, tables)}
    for old, new, ref in zip(before, kv_b.k + kv_b.v, kv_a.k + kv_a.v):
        changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert set(changed) <= live          # the padding row wrote no KV anywhere
        torch.testing.assert_close(new, ref)
