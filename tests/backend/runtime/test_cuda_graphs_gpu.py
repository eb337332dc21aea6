"""On a GPU: decode CUDA graphs give the same greedy tokens as eager decode (tiny model, fp32)."""
from __future__ import annotations

import pytest
import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _generate(graphs: bool, prompts, params) -> list[list[int]]:
    e = LLMEngine(EngineConfig(model="dummy:tiny-llama", device="cuda", num_pages=128, page_size=4, max_running=8,
                               max_step_tokens=64, max_prefill_chunk=16, cuda_graphs=graphs))
    assert (e.runner.graphs is not None) == graphs
    for i, (p, sp) in enumerate(zip(prompts, params)):
        e.add_request(str(i), p, sp)
    out: dict[str, list[int]] = {}
    while e.has_work:
        for o in e.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    assert e.stats().pool.active == 0
    return [out[str(i)] for i in range(len(prompts))]


def test_graphs_equal_eager_greedy_tokens_with_padding():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 41)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 14, 9, 6, 3)]
    assert _generate(True, prompts, params) == _generate(False, prompts, params)


def test_graphs_sample_on_the_device():
    prompts = [[5, 6, 7, 8]] * 3
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]
    out = _generate(True, prompts, params)
    assert all(len(t) == 8 and all(0 <= x < 256 for x in t) for t in out)


def test_cascade_graphs_equal_plain_graphs_on_shared_prompts():
    """Rows sharing a system prompt's pages replay the cascade decode graphs; same greedy tokens."""
    from collections import Counter

    from kvshare.runtime.cascade_planner import CascadePolicy

    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 250, (24,), generator=g).tolist()            # 6 full pages of 4
    prompts = [system + torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 5, 2, 7, 4, 6)]

    def run(cascade: bool) -> tuple[list[list[int]], Counter]:
        e = LLMEngine(EngineConfig(model="dummy:tiny-llama", device="cuda", num_pages=256, page_size=4, max_running=8,
                                   max_step_tokens=256, max_prefill_chunk=64, cascade_attention=cascade))
        if cascade:   # the tiny model reads kilobytes: drop the byte thresholds, keep the graphs' batch sizes
            e.runner.cascade = CascadePolicy(min_batch=4, min_shared_pages=2, min_saved_read_gb_graph=0.0)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        out: dict[str, list[int]] = {}
        paths: Counter = Counter()

        def step() -> None:
            for o in e.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
            paths[e.runner.last_path] += 1

        e.add_request("0", prompts[0], params)
        while "0" not in out:          # the system prompt's pages are computed (and cached) once
            step()
        for i, p in enumerate(prompts[1:], 1):
            e.add_request(str(i), p, params)
        while e.has_work:
            step()
        assert e.stats().pool.active == 0
        if cascade:
            e.runner.graphs.cascade_plans.check_integrity()
        return [out[str(i)] for i in range(len(prompts))], paths

    with_cascade, paths = run(True)
    plain, plain_paths = run(False)
    assert paths["cascade-graph"] > 0 and plain_paths["cascade-graph"] == 0
    assert with_cascade == plain


def test_the_page_copy_kernel_runs_at_start_up_and_leaves_the_pool_zero(monkeypatch):
    """Copy-on-write's kernel is launched once while the engine starts (its JIT compile mid-serving
    stalled every stream), copying free page 0 over free page 1: the pool stays all zeros."""
    from kvshare.runtime.model_runner import ModelRunner

    calls = []
    real = ModelRunner.copy_pages
    monkeypatch.setattr(ModelRunner, "copy_pages", lambda self, copies: calls.append(list(copies)) or real(self, copies))
    e = LLMEngine(EngineConfig(model="dummy:tiny-llama", device="cuda", num_pages=32, page_size=4, max_running=4))
    assert calls == [[(0, 1)]]
    assert all(int(t.count_nonzero()) == 0 for t in e.kv.page_tensors())
