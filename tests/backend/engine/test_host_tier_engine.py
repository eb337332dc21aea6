"""The host tier through the engine on the CPU (real page copies, tiny random model): a prompt whose
cached pages were evicted from a small pool comes back from the host with the same tokens as if its
pages had stayed on the device, and without the tier it is recomputed."""
from __future__ import annotations

import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.sampling_params import SamplingParams


def prompt_kv(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """The K and V of the prompt's cached full pages, all layers, in prompt order."""
    pages = [e.page for e in engine.scheduler.kv.prefix.match(prompt, b"", max_tokens=len(prompt) - 1).full]
    index = torch.tensor(pages)
    return torch.stack([t.index_select(0, index) for t in (*engine.kv.k, *engine.kv.v)])


def run_sequence(num_pages: int, host_gb: float) -> tuple[LLMEngine, list[tuple[list[int], int]]]:
    """A twice (its pages get shared: worth keeping), then B (which pushes them out of a small pool),
    then A again, one at a time."""
    engine = LLMEngine(EngineConfig(model="dummy:tiny-llama", num_pages=num_pages, page_size=4, max_running=2,
                                    max_step_tokens=32, max_prefill_chunk=16, debug_checks=True,
                                    host_cache_memory_gb=host_gb))
    g = torch.Generator().manual_seed(9)
    prompt_a = torch.randint(3, 250, (29,), generator=g).tolist()   # 7 full pages + its last token
    prompt_b = torch.randint(3, 250, (40,), generator=g).tolist()
    results: list = []
    for i, prompt in enumerate((prompt_a, prompt_a, prompt_b, prompt_a)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        tokens, cached = [], None
        while engine.has_work:
            for out in engine.step():
                tokens += list(out.token_ids)
                if out.finished:
                    cached = out.cached_tokens
        results.append((tokens, cached))
    results.append(prompt_kv(engine, prompt_a))
    pool = engine.stats().pool
    assert pool.active == 0 and pool.free + pool.cached == pool.total
    engine.check_integrity()
    return engine, results


def test_evicted_prefix_is_loaded_back_from_the_host():
    _, roomy = run_sequence(num_pages=64, host_gb=0.0)              # A's pages stay on the device
    _, recompute = run_sequence(num_pages=13, host_gb=0.0)          # B evicts them: A is recomputed
    engine, tiered = run_sequence(num_pages=13, host_gb=0.001)      # B evicts them to the host tier
    assert engine.kv.host_pages > 0
    assert roomy[3][1] == 28                                          # 7 full pages of 4 (never the last token)
    assert recompute[3][1] < 28                                       # B evicted A's tail pages...
    assert tiered[3][1] == 28                                         # ... which the tier brings back
    assert torch.equal(tiered[4], roomy[4])                           # the loaded pages hold A's own KV
    assert tiered[3][0] == roomy[3][0]                                # hence the same greedy tokens
    from_host = 28 - recompute[3][1]                                  # the same pages were evicted in both runs
    assert engine.scheduler.kv.host_hits_tokens_total == from_host
    assert engine.scheduler.kv.host.loads_total == from_host // 4
