"""Sliding-window page release through the engine, on the CPU with the tiny random Llama given a
window in every layer (issue #39): the engine takes the window from the model, released slots reach
the runner as -1, and the tokens are the ones the same model gives when every page is kept."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kvshare.core.window import RELEASED, max_pages_held
from kvshare.engine.engine import LLMEngine, release_window
from kvshare.engine.engine_config import EngineConfig
from kvshare.engine.outputs import InvalidRequest
from kvshare.runtime.model_config import NAMED_CONFIGS
from kvshare.runtime.weights import load_model
from kvshare.sampling_params import SamplingParams

PAGE = 4
WINDOW = 12
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(5).randrange(3, 250) for _ in range(60)]


def windowed_model(window: int = WINDOW):
    loaded = load_model("dummy:tiny-llama", dtype=torch.float32, device="cpu", seed=0)
    layers = (window,) * loaded.config.num_layers
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, layer_windows=layers))


def engine(loaded, **kw) -> LLMEngine:
    base = dict(model="dummy:tiny-llama", page_size=PAGE, num_pages=64, max_running=4, max_step_tokens=32,
                max_prefill_chunk=16, debug_checks=True, cpu_weights="fp32")
    base.update(kw)
    return LLMEngine(EngineConfig(**base), loaded)


def run(eng: LLMEngine, requests: dict[str, list[int]], *, fork_of: dict[str, str] | None = None,
        watch: list | None = None) -> dict[str, list[int]]:
    """Greedy outputs; watch collects (request's page table, pages held) after every step."""
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, prompt in requests.items():
        eng.add_request(rid, prompt, GREEDY, fork_of=(fork_of or {}).get(rid))
    kv = eng.scheduler.kv
    for _ in range(2000):
        if not eng.has_work:
            break
        for o in eng.step():
            out[o.request_id] += list(o.token_ids)
            assert o.error is None, o.error
        if watch is not None:
            for state in list(eng._by_seq.values()):
                if kv.has(state.seq_id):
                    watch.append((kv.page_table(state.seq_id), kv.pages_held(state.seq_id)))
    assert not eng.has_work
    eng.check_integrity()
    stats = eng.stats().pool
    assert stats.active == 0 and stats.free + stats.cached == stats.total
    return out


def test_the_window_comes_from_the_model_and_a_wrong_one_is_refused() -> None:
    model = dataclasses.replace(NAMED_CONFIGS["tiny-llama"], layer_windows=(8, 8))
    mixed = dataclasses.replace(NAMED_CONFIGS["tiny-llama"], layer_windows=(8, 0))
    full = NAMED_CONFIGS["tiny-llama"]
    assert [release_window(None, m) for m in (model, mixed, full)] == [8, 0, 0]
    assert release_window(0, model) == 0 and release_window(8, model) == 8
    with pytest.raises(ValueError, match="kv_release_window=4 but the model's layers do not all attend a window of 4"):
        release_window(4, model)
    with pytest.raises(ValueError, match="its kv_release_window is 0"):
        release_window(8, mixed)
    with pytest.raises(ValueError, match="must be >= 0"):
        release_window(-1, model)
    loaded = windowed_model()
    assert engine(loaded).scheduler.kv.window == WINDOW
    assert engine(loaded, kv_release_window=0).scheduler.kv.window == 0


def test_released_pages_give_the_tokens_of_keeping_every_page() -> None:
    loaded = windowed_model()
    watch: list = []
    released = run(engine(loaded), {"a": PROMPT}, watch=watch)
    kept = run(engine(loaded, kv_release_window=0), {"a": PROMPT})
    assert released == kept and len(released["a"]) == GREEDY.max_tokens
    # the runner saw released slots, and the request never held more than its window's pages
    assert any(table[0] == RELEASED for table, _ in watch)
    longest = len(PROMPT) + GREEDY.max_tokens - 1
    assert max(held for _, held in watch) <= max_pages_held(longest, WINDOW, PAGE)
    assert max(held for _, held in watch) < -(-longest // PAGE)


def test_a_pool_that_holds_only_the_window_serves_a_request_longer_than_the_pool() -> None:
    loaded = windowed_model()
    reference = run(engine(loaded, kv_release_window=0), {"a": PROMPT})
    small = engine(loaded, num_pages=10)                  # 40 tokens of pool for an 83-token request
    assert run(small, {"a": PROMPT}) == reference
    with pytest.raises(InvalidRequest, match="whole page pool"):
        engine(loaded, num_pages=10, kv_release_window=0).add_request("a", PROMPT, GREEDY)


def test_prefix_hits_and_parallel_samples_with_a_window() -> None:
    loaded = windowed_model()
    reference = run(engine(loaded, kv_release_window=0), {"a": PROMPT})["a"]
    eng = engine(loaded)
    assert run(eng, {"a": PROMPT})["a"] == reference
    # the same prompt again: its pages were registered before their release, so they hit
    hits_before = eng.stats().pool.prefix_hits_tokens_total
    assert run(eng, {"b": PROMPT})["b"] == reference
    assert eng.stats().pool.prefix_hits_tokens_total - hits_before == len(PROMPT) - 1     # 14 pages + 3 copied
    # parallel samples: c2 and c3 fork c1 (or go through the prefix cache when c1 released a page they read)
    forks = run(eng, {"c1": PROMPT, "c2": PROMPT, "c3": PROMPT}, fork_of={"c2": "c1", "c3": "c1"})
    assert forks == {"c1": reference, "c2": reference, "c3": reference}


def test_overlap_scheduling_with_a_window() -> None:
    loaded = windowed_model()
    reference = run(engine(loaded, kv_release_window=0), {"a": PROMPT, "b": PROMPT[:37]})
    assert run(engine(loaded, overlap_schedule=True), {"a": PROMPT, "b": PROMPT[:37]}) == reference
