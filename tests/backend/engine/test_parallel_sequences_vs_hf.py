"""num_return_sequences and beam search on SmolLM2 against HF transformers' generate: same tokens.

Greedy n > 1 sequences are n copies of HF's greedy output, forked from one prefill; beam search
(beam_width W) returns HF's ``generate(num_beams=W, num_return_sequences=W)`` beams in HF's order.
Runs the real weights on the CPU (fp32), with the pool's integrity checked after every step.
"""
from __future__ import annotations

import pytest
import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.runtime.tokenizer import hf_location, default_model_source
from kvshare.sampling_params import SamplingParams

PROMPTS = ["The history of the Roman empire is", "Write a short poem about the sea.", "def fibonacci(n):"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(debug_checks=True, max_running=16))


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM
    where, kwargs = hf_location(default_model_source())
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
    return model.eval()


def run(engine: LLMEngine, requests: dict) -> dict:
    for rid, (ids, params, fork_of) in requests.items():
        engine.add_request(rid, ids, params, fork_of=fork_of)
    finals, tokens = {}, {rid: [] for rid in requests}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids      # deltas
            if out.finished:
                finals[out.request_id] = out
    engine.check_integrity()
    assert engine.stats().pool.active == 0
    return {rid: (finals[rid], tokens[rid]) for rid in requests}


def hf_generate(hf, ids: list[int], eos: list[int], **kwargs) -> list[list[int]]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                          **kwargs)
    rows = [row[len(ids):].tolist() for row in out]
    # HF pads finished rows after their EOS; kvshare's tokens end at the EOS
    return [row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_forked_sequences_equal_hf_greedy(engine, hf, prompt):
    ids = engine.tokenizer.encode(prompt)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    finals = run(engine, {"s0": (ids, greedy, None), "s1": (ids, greedy, "s0"), "s2": (ids, greedy, "s0")})
    expected = hf_generate(hf, ids, list(engine.eos_ids))[0]
    assert [finals[f"s{i}"][1] for i in range(3)] == [expected] * 3
    # the forks computed one token of the prompt each: the rest came from s0's pages
    assert finals["s0"][0].cached_tokens == 0
    assert finals["s1"][0].cached_tokens == finals["s2"][0].cached_tokens == len(ids) - 1


@pytest.mark.parametrize("prompt,width", [(PROMPTS[0], 2), (PROMPTS[1], 3), (PROMPTS[2], 4)])
def test_beam_search_equals_hf_beam_search(engine, hf, prompt, width):
    ids = engine.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, beam_width=width)
    beams = run(engine, {"b": (ids, params, None)})["b"][0].beams
    expected = hf_generate(hf, ids, list(engine.eos_ids), num_beams=width, num_return_sequences=width)
    assert [list(b.token_ids) for b in beams] == expected
    assert all(a.score >= b.score for a, b in zip(beams, beams[1:]))


def test_beam_search_length_penalty_reorders_like_hf(engine, hf):
    ids = engine.tokenizer.encode(PROMPTS[1])
    for penalty in (0.0, 3.0):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, beam_width=3, length_penalty=penalty)
        beams = run(engine, {"b": (ids, params, None)})["b"][0].beams
        expected = hf_generate(hf, ids, list(engine.eos_ids), num_beams=3, num_return_sequences=3,
                               length_penalty=penalty)
        assert [list(b.token_ids) for b in beams] == expected


def test_beam_request_cancel_frees_every_page(engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    engine.add_request("b", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, beam_width=3))
    for _ in range(3):
        engine.step()
    out = engine.abort("b")
    assert out is not None and out.finished and out.finish_reason == "cancelled"
    while engine.has_work:
        engine.step()
    engine.check_integrity()
    assert engine.stats().pool.active == 0 and not engine.request_ids()


def test_context_and_generation_logits_equal_hf_logits(engine, hf):
    ids = engine.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=3, temperature=0.0, return_context_logits=True,
                            return_generation_logits=True, logprobs=0)
    engine.add_request("warm", ids, SamplingParams(max_tokens=2, temperature=0.0))   # the prompt's pages cached
    outs = []
    while engine.has_work:
        outs += engine.step()
    engine.add_request("ctx", ids, params)
    outs = []
    while engine.has_work:
        outs += [o for o in engine.step() if o.request_id == "ctx"]
    context = outs[0].context_logits
    generated = [row for o in outs for row in o.generation_logits]
    tokens = [t for o in outs for t in o.token_ids]
    with torch.inference_mode():
        full = hf(torch.tensor([ids + tokens[:-1]])).logits[0].float()
    assert context.shape == (len(ids), full.shape[-1])     # every prompt position, though the prompt was cached
    torch.testing.assert_close(context, full[:len(ids)], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(torch.stack(generated), full[len(ids) - 1:], rtol=1e-3, atol=1e-3)
    logp = torch.log_softmax(full[len(ids) - 1:], dim=-1)
    expected = [logp[i, t].item() for i, t in enumerate(tokens)]
    assert [lp for o in outs for lp in o.logprobs] == pytest.approx(expected, abs=1e-3)
    engine.check_integrity()


def test_forks_over_a_cached_prompt_leave_the_prefix_cache_intact(engine, hf):
    """The parent's prompt is cached (its last page partial: a copy-on-write at admission); the forks
    must wait for that copy, or they copy an empty page and register it as the prompt's prefix."""
    ids = engine.tokenizer.encode("The capital of France is")     # shorter than a page: all partial
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = hf_generate(hf, ids, list(engine.eos_ids))[0]
    assert run(engine, {"warm": (ids, greedy, None)})["warm"][1] == expected
    forked = run(engine, {"s0": (ids, greedy, None), "s1": (ids, greedy, "s0"), "s2": (ids, greedy, "s0")})
    assert [forked[f"s{i}"][1] for i in range(3)] == [expected] * 3
    assert run(engine, {"again": (ids, greedy, None)})["again"][1] == expected
