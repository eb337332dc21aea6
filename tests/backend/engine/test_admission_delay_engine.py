"""The admission delay through the engine (EngineConfig.admission_delay_steps): arrivals trickling
into a nearly full batch share fewer mixed steps, every request still ends with all its tokens, and
the pool comes back whole (the scheduler-level rule is tested in tests/core/test_admission_delay.py)."""
from __future__ import annotations

import pytest
import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.sampling_params import SamplingParams


def run_trickle(delay: int, overlap: bool) -> tuple[int, dict[str, int]]:
    """7 long requests fill 7 of 8 slots; then one short request arrives per step. Returns the number
    of mixed steps (prefill and decode rows together) and each request's output token count."""
    engine = LLMEngine(EngineConfig(model="dummy:tiny-llama", num_pages=128, page_size=4, max_running=8,
                                    max_step_tokens=64, max_prefill_chunk=16, debug_checks=True,
                                    overlap_schedule=overlap, admission_delay_steps=delay))
    g = torch.Generator().manual_seed(3)
    prompt = lambda n: torch.randint(3, 250, (n,), generator=g).tolist()  # noqa: E731
    greedy = dict(temperature=0.0, ignore_eos=True)
    for i in range(7):
        engine.add_request(f"long{i}", prompt(6), SamplingParams(max_tokens=40, **greedy))
    counts: dict[str, int] = {}
    mixed, arrivals, steps = 0, 0, 0
    while engine.has_work or arrivals < 12:
        if steps >= 3 and arrivals < 12:         # the long ones decode by now
            engine.add_request(f"short{arrivals}", prompt(5), SamplingParams(max_tokens=4, **greedy))
            arrivals += 1
        for out in engine.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.token_ids)
            if out.finished:
                assert out.finish_reason == "length"
        shape = engine.last_step
        mixed += shape.decode_rows > 0 and shape.prefill_tokens > 0
        steps += 1
        assert steps < 500
    pool = engine.stats().pool
    assert pool.active == 0 and pool.free + pool.cached == pool.total
    engine.check_integrity()
    return mixed, counts


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_delay_batches_arrivals_into_fewer_mixed_steps(overlap):
    mixed_now, counts_now = run_trickle(0, overlap)
    mixed_delayed, counts_delayed = run_trickle(4, overlap)
    expected = {**{f"long{i}": 40 for i in range(7)}, **{f"short{i}": 4 for i in range(12)}}
    assert counts_now == expected and counts_delayed == expected
    assert mixed_delayed < mixed_now
