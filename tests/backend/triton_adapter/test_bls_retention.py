"""FinishedStreams: a finished BLS stream is released only after its hold, by a later keep() or clear()."""
from __future__ import annotations

import gc
import weakref

from kvshare.triton_adapter.bls_retention import FinishedStreams


class _Stream:
    pass


def test_a_stream_is_held_for_its_time_then_released_by_a_later_keep():
    now = [0.0]
    finished = FinishedStreams(hold_s=5.0, clock=lambda: now[0])
    first = _Stream()
    ref = weakref.ref(first)
    finished.keep(first)
    del first
    now[0] = 4.9
    finished.keep(_Stream())
    gc.collect()
    assert ref() is not None and len(finished) == 2
    now[0] = 5.0
    finished.keep(_Stream())
    gc.collect()
    assert ref() is None and len(finished) == 2


def test_clear_releases_every_stream():
    finished = FinishedStreams(hold_s=60.0, clock=lambda: 0.0)
    streams = [_Stream() for _ in range(3)]
    refs = [weakref.ref(s) for s in streams]
    for s in streams:
        finished.keep(s)
    del streams, s
    finished.clear()
    gc.collect()
    assert len(finished) == 0 and all(r() is None for r in refs)
