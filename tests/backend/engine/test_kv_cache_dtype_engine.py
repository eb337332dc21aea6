"""kv_cache_dtype through the engine on the CPU (tiny random Llama, the torch reference kernels): 8-bit
pages are sized from their real bytes, batching and prefix sharing give the tokens of one request at a
time, a forked copy-on-write page carries its scales, the host tier moves K, V and int8's scales
together, and every page comes back. The accuracy against 16-bit pages is measured on SmolLM2 by
perf/engine/kv_dtype_accuracy.py and checked through the real server (test_kv_cache_dtype_server.py)."""
from __future__ import annotations

import os

import pytest
import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.runtime.cpu_linear import rows_batch_invariant
from kvshare.runtime.kv_cache import KVCache, kv_storage_dtype, pages_for_memory
from kvshare.runtime.model_config import NAMED_CONFIGS
from kvshare.sampling_params import SamplingParams
from kvshare_kernels import kv_quant

QUANTIZED = ["fp8_e4m3", "int8"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def make_engine(kv_cache_dtype: str, **kw) -> LLMEngine:
    cfg = dict(model="dummy:tiny-llama", num_pages=64, page_size=4, max_running=8, max_step_tokens=64,
               max_prefill_chunk=16, debug_checks=True, kv_cache_dtype=kv_cache_dtype)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def run(engine: LLMEngine, requests: dict[str, list[int]], params=GREEDY) -> dict[str, tuple[list[int], int]]:
    """Submit all, step to the end: (tokens, cached_tokens) per request; the pool must be idle after."""
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, tuple[list[int], int]] = {rid: ([], 0) for rid in requests}
    while engine.has_work:
        for o in engine.step():
            toks, cached = out[o.request_id]
            out[o.request_id] = (toks + list(o.token_ids), o.cached_tokens if o.finished else cached)
    pool = engine.stats().pool
    assert pool.active == 0 and pool.free + pool.cached == pool.total
    engine.check_integrity()
    return out


def prompts(n: int, length: int = 13, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def test_unknown_kv_cache_dtype_names_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, int8, got 'fp4'"):
        make_engine("fp4")
    assert EngineConfig.from_mapping({"kv_cache_dtype": "int8"}).kv_cache_dtype == "int8"


def test_pages_for_memory_counts_8bit_bytes_and_scales():
    cfg = NAMED_CONFIGS["llama-2-7b"]       # head_dim 128
    budget = 40 * 2**30
    p16 = pages_for_memory(cfg, page_size=16, dtype=torch.float16, budget_bytes=budget)
    p8 = pages_for_memory(cfg, page_size=16, dtype=kv_storage_dtype("fp8_e4m3", torch.float16), budget_bytes=budget)
    pi8 = pages_for_memory(cfg, page_size=16, dtype=kv_storage_dtype("int8", torch.float16), budget_bytes=budget)
    assert p8 == 2 * p16                     # 128 vs 256 bytes per token and head
    assert pi8 == budget // (2 * 32 * 16 * 32 * (128 + 4))      # int8 + one float32 scale per token and head
    assert 1.9 < pi8 / p16 < 2
    kv = KVCache.allocate(NAMED_CONFIGS["tiny-llama"], num_pages=5, page_size=4, dtype=torch.int8,
                          device=torch.device("cpu"), host_pages=3)
    assert [t.shape[0] for t in kv.page_tensors()] == [5] * 8 and [t.shape[0] for t in kv.host_page_tensors()] == [3] * 8
    assert [t.dtype for t in kv.page_tensors()] == [t.dtype for t in kv.host_page_tensors()]
    assert kv.nbytes == 5 * 4 * kv.bytes_per_token


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_pool_layout_and_batched_equals_one_at_a_time(kv_cache_dtype):
    engine = make_engine(kv_cache_dtype)
    assert engine.kv.dtype == kv_storage_dtype(kv_cache_dtype, torch.float32)
    assert len(engine.kv.page_tensors()) == (8 if kv_cache_dtype == "int8" else 4)    # 2 layers
    ps = prompts(5)
    solo = [run(make_engine(kv_cache_dtype), {str(i): p})[str(i)][0] for i, p in enumerate(ps)]
    together = run(engine, {str(i): p for i, p in enumerate(ps)})
    assert [together[str(i)][0] for i in range(5)] == solo


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_shared_prefix_pages_give_the_recomputed_tokens(kv_cache_dtype):
    """A cached quantized page holds exactly what a recompute would store: same tokens with sharing on or off."""
    base = prompts(1, length=22)[0]
    requests = {f"r{i}": base + [40 + i, 41 + i, 42] for i in range(4)}
    shared = make_engine(kv_cache_dtype)
    first = run(shared, {"r0": requests["r0"]})
    rest = run(shared, {k: v for k, v in requests.items() if k != "r0"})
    assert all(cached >= 20 for _, cached in rest.values())         # 5 full pages of the common 22 tokens
    alone = run(make_engine(kv_cache_dtype, enable_prefix_caching=False), requests)
    assert {**first, **rest}.keys() == alone.keys()
    assert all(({**first, **rest})[k][0] == alone[k][0] for k in requests)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_forks_copy_pages_with_their_scales(kv_cache_dtype):
    """Two forks of a request (num_return_sequences 3) share the prompt's pages; the partial last page is copied on write: every
    sample must equal the single greedy answer (a copy that lost its scales would not)."""
    prompt = prompts(1, length=18)[0]         # 4 full pages + 2 tokens: the last page is shared, then copied
    single = run(make_engine(kv_cache_dtype), {"a": prompt})["a"][0]
    engine = make_engine(kv_cache_dtype)
    engine.add_request("n0", prompt, GREEDY)
    for i in (1, 2):
        engine.add_request(f"n{i}", prompt, GREEDY, fork_of="n0")
    got: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert len(got) == 3 and all(toks == single for toks in got.values())
    pool = engine.stats().pool
    assert pool.active == 0
    engine.check_integrity()


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_host_tier_moves_values_and_scales(kv_cache_dtype):
    """A's pages evicted to the host tier by B and loaded back hold A's own bytes (values and scales)."""
    def sequence(num_pages: int, host_gb: float):
        engine = make_engine(kv_cache_dtype, num_pages=num_pages, max_running=2, max_step_tokens=32,
                             host_cache_memory_gb=host_gb)
        g = torch.Generator().manual_seed(9)
        a = torch.randint(3, 250, (29,), generator=g).tolist()
        b = torch.randint(3, 250, (40,), generator=g).tolist()
        outs = [run(engine, {f"r{i}": p}, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[f"r{i}"]
                for i, p in enumerate((a, a, b, a))]
        pages = [e.page for e in engine.scheduler.kv.prefix.match(a, b"", max_tokens=len(a) - 1).full]
        index = torch.tensor(pages)
        held = [kv_quant.storage_view(t).index_select(0, index) for t in engine.kv.page_tensors()]
        return engine, outs, held

    _, roomy, roomy_pages = sequence(64, 0.0)
    engine, tiered, tiered_pages = sequence(13, 0.001)
    assert engine.kv.host_pages > 0 and engine.scheduler.kv.host.loads_total > 0
    assert tiered[3] == roomy[3] and tiered[3][1] == 28
    assert all(torch.equal(x, y) for x, y in zip(tiered_pages, roomy_pages))


@pytest.mark.skipif(os.environ.get("KVSHARE_CPU_LINEAR") == "0" or not rows_batch_invariant(),
                    reason="the linear layers' rows are not batch-invariant here (KVSHARE_CPU_LINEAR=0: F.linear's "
                           "sgemm rounds a chunk of fewer than 12 rows its own way; or a CPU where oneDNN's do not hold)")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("length", [13, 14, 16])
def test_a_repeated_prompt_gets_its_first_runs_logits_bit_for_bit(kv_cache_dtype, length):
    """The second run reads the first run's prefix pages and computes only its tail, 1-3 tokens here:
    its rows must get the bits the first run's longer prefill gave them (runtime/cpu_attention.py,
    cpu_linear.py), else a near-tie in a real model flips a greedy token (docs/decisions.md)."""
    prompt = prompts(1, length=length)[0]
    engine = make_engine(kv_cache_dtype)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_generation_logits=True)
    runs = []
    for rid in ("first", "again"):
        engine.add_request(rid, prompt, params)
        outs = []
        while engine.has_work:
            outs += engine.step()
        runs.append((torch.stack([row for o in outs for row in o.generation_logits]), outs[-1].cached_tokens))
    (first, _), (again, cached) = runs
    assert 1 <= length - cached <= 3
    assert torch.equal(again, first)
