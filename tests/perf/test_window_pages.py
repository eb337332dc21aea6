"""perf/core/window_pages.py: the pages a windowed request holds, replayed through the real core (no model)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.core import window_pages as wp  # noqa: E402


def test_a_windowed_request_holds_its_window_and_full_attention_everything() -> None:
    full, windowed = wp.grow_one(4096, 0, 16), wp.grow_one(4096, 512, 16)
    assert max(h for _, h in full.held) == 256 and wp.at(full, 4096) == 256
    # prefill chunks of 512 on a window of 512: the chunk's 32 pages and the 32 before it (+1 at most)
    assert max(h for _, h in windowed.held) == 64 <= wp.max_pages_held(4096, 512, 16, chunk=512)
    decode = max(h for end, h in windowed.held if end > 4096 - wp.DECODE_TOKENS)
    assert decode == wp.max_pages_held(4096, 512, 16) == 33
    assert full.steps == windowed.steps


def test_the_window_lets_every_request_of_a_small_pool_run_at_once() -> None:
    full = wp.crowd(4, 4096, 0, 16, 512)                 # a pool of two requests' pages
    windowed = wp.crowd(4, 4096, 512, 16, 512)
    assert full.finished == windowed.finished == 4
    assert windowed.max_running == 4 and windowed.preemptions == 0 and windowed.peak_active <= 4 * 65
    assert full.preemptions > 0 and windowed.steps < full.steps     # full attention: admitted, then preempted
