"""The CPU engine on SmolLM2's GGUF blocks (cpu_weights=blocks, the default) beside the same engine on
the fp32 weights transformers widens them to: the same answers, to float32 summation order."""
from __future__ import annotations

import pytest
import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.runtime.weights import load_model
from kvshare.sampling_params import SamplingParams
from kvshare_kernels import block_linear as bl


@pytest.fixture(scope="module")
def fp32_model():
    return load_model(None)


@pytest.mark.skipif(not bl.available(), reason="the CPU block kernel does not run here")
def test_the_block_engine_answers_like_the_fp32_engine(fp32_model, tokenizer):
    blocks = load_model(None, cpu_blocks=True)
    assert isinstance(blocks.weights.layers[0].gate_up, bl.BlockWeight)
    assert isinstance(blocks.weights.lm_head, bl.BlockWeight)
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Water boils at")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, return_generation_logits=True)
    answers = []
    for loaded, weights in ((fp32_model, "fp32"), (blocks, "blocks")):
        engine = LLMEngine(EngineConfig(num_pages=64, max_running=4, debug_checks=True, cpu_weights=weights),
                           loaded=loaded)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        outs: dict[str, list] = {}
        while engine.has_work:
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
        answers.append({rid: ([t for o in os_ for t in o.token_ids],
                              torch.stack([row for o in os_ for row in o.generation_logits])) for rid, os_ in outs.items()})
    fp32, blk = answers
    for rid in fp32:
        a, b = fp32[rid][1][0], blk[rid][1][0]
        # The same weights summed in another order: the first step's logits agree to float32 noise.
        assert torch.allclose(a, b, atol=2e-3, rtol=0), (rid, (a - b).abs().max())
    same = sum(x == y for rid in fp32 for x, y in zip(fp32[rid][0], blk[rid][0]))
    assert same >= 0.9 * sum(len(fp32[rid][0]) for rid in fp32), (fp32, blk)


def test_unknown_cpu_weights_is_refused_by_name():
    with pytest.raises(ValueError, match="cpu_weights"):
        LLMEngine(EngineConfig(model="dummy:tiny-llama", num_pages=16, cpu_weights="int4"))
