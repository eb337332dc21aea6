"""prefill_tiles.plan_tiles: the prefill kernel's work list covers every query block once."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare_kernels.prefill_tiles import IDLE, plan_tiles, tile_capacity, tokens_per_tile


@st.composite
def steps(draw):
    n = draw(st.integers(1, 12))
    q = draw(st.lists(st.integers(0, 70), min_size=n, max_size=n))
    prefix = draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    return np.array(q), np.array(q) + np.array(prefix), draw(st.sampled_from([1, 4, 16, 64]))


@settings(max_examples=200, deadline=None)
@given(steps(), st.integers(0, 40), st.booleans())
def test_every_block_once_in_order_then_idle(step, extra_rows, longest_first):
    q, ctx, per_tile = step
    cap = tile_capacity(int(q.sum()) + extra_rows, len(q) + extra_rows, per_tile)
    tiles = plan_tiles(q, ctx, per_tile, cap, longest_first=longest_first)
    assert tiles.shape == (cap, 2) and tiles.dtype == np.int32
    live = tiles[tiles[:, 0] != IDLE]
    want = [(b, m) for b in range(len(q)) for m in range(-(-int(q[b]) // per_tile))]    # the grid's order
    assert sorted(map(tuple, live.tolist())) == want
    assert (tiles[len(live):, 0] == IDLE).all() and (tiles[len(live):, 1] == 0).all()
    if longest_first:
        keys = (ctx - q)[live[:, 0]] + np.minimum((live[:, 1] + 1) * per_tile, q[live[:, 0]])
        assert (np.diff(keys) <= 0).all()
    else:
        assert list(map(tuple, live.tolist())) == want


def test_capacity_is_enough_for_any_split():
    # the worst case: every request one token past a block boundary
    per_tile = 16
    q = np.array([17] * 10)
    tiles = plan_tiles(q, q, per_tile, tile_capacity(170, 10, per_tile))
    assert (tiles[:, 0] != IDLE).sum() == 20 <= tiles.shape[0]


def test_too_small_a_list_and_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        plan_tiles(np.array([40]), np.array([40]), 16, 2)
    with pytest.raises(ValueError, match="query_lens must be"):
        plan_tiles(np.array([5]), np.array([4]), 16)


def test_tokens_per_tile_follows_the_group():
    assert tokens_per_tile(32, 8) == 16        # 4 query heads per KV head: 64 rows = 16 tokens x 4
    assert tokens_per_tile(32, 32) == 64
    assert tokens_per_tile(9, 3, 16) == 4         # a group of 3 is padded to 4 rows
