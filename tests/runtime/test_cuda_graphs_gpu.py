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
