"""HostTier bookkeeping: slots never lost or doubled, pinned slots never reused within a step, runs
verified by parent key, salt and tokens."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.core.host_tier import HostTier


def key(i: int) -> bytes:
    return i.to_bytes(4, "little")


def test_store_match_take_release():
    tier = HostTier(3)
    root = b"root"
    a = tier.store(key(1), root, b"", (1, 2))
    b = tier.store(key(2), key(1), b"", (3, 4))
    assert {a, b} == {0, 1}
    assert tier.store(key(1), root, b"", (1, 2)) is None          # already here: no second copy
    run = tier.match([key(1), key(2), key(3)], root, b"", [(1, 2), (3, 4), (5, 6)])
    assert [e.slot for e in run] == [a, b]
    assert tier.match([key(1)], root, b"other salt", [(1, 2)]) == []
    assert tier.match([key(1)], root, b"", [(9, 9)]) == []        # same key, other tokens: a collision
    assert tier.match([key(2)], root, b"", [(3, 4)]) == []         # wrong parent
    tier.release_pins()
    taken = tier.take(key(1))
    assert taken.slot == a and key(1) not in tier
    tier.check_integrity()
    # the taken slot is still pinned (its load has not run): a full tier evicts key(2), not slot a
    c = tier.store(key(3), root, b"", (7, 8))
    d = tier.store(key(4), root, b"", (9, 9))
    assert a not in (c, d)
    tier.release_pins()
    tier.check_integrity()
    assert len(tier) == 2 and tier.evictions_total == 1


def test_all_slots_pinned_refuses():
    tier = HostTier(1)
    assert tier.store(key(1), b"r", b"", (1,)) == 0
    assert tier.store(key(2), b"r", b"", (2,)) is None            # slot 0 was written this step
    tier.release_pins()
    assert tier.store(key(2), b"r", b"", (2,)) == 0                # evicts key(1)
    assert key(1) not in tier


def test_rejects_empty_tier():
    with pytest.raises(ValueError, match="num_slots"):
        HostTier(0)


ops = st.lists(st.tuples(st.sampled_from(["store", "take", "release"]), st.integers(0, 11)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), ops)
def test_random_operations_keep_slots_consistent(num_slots, operations):
    tier = HostTier(num_slots)
    written_this_step: set[int] = set()      # slots a copy of this step reads or writes
    contents: dict[int, bytes] = {}          # slot -> key whose page it holds
    for op, i in operations:
        if op == "store":
            slot = tier.store(key(i), b"p", b"", (i,))
            if slot is not None:
                assert slot not in written_this_step, "a slot reused within one step"
                written_this_step.add(slot)
                contents[slot] = key(i)
        elif op == "take" and key(i) in tier:
            entry = tier.take(key(i))
            assert contents[entry.slot] == key(i)                      # the slot still holds that page
            written_this_step.add(entry.slot)
        elif op == "release":
            tier.release_pins()
            written_this_step.clear()
        tier.check_integrity()
        assert len(tier) <= num_slots
