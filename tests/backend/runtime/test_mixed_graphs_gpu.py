"""On a GPU: mixed-step CUDA graphs (prefill chunks beside decode rows) give the eager steps' greedy
tokens, with overlap scheduling and without (tiny model, fp32), and in bf16, where the prefill
kernel reads each chunk's keys from the step and the engine builds its work lists with that
launch's block."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _generate(mixed_tokens: int, overlap: bool, page_size: int = 4, dtype: str = "float32",
              num_pages: int = 256) -> tuple[list[list[int]], Counter]:
    e = LLMEngine(EngineConfig(model="dummy:tiny-llama", device="cuda", dtype=dtype, num_pages=num_pages,
                               page_size=page_size, max_running=8, max_step_tokens=96, max_prefill_chunk=24,
                               mixed_graph_max_tokens=mixed_tokens, overlap_schedule=overlap))
    assert (e.runner.mixed_graphs is not None) == (mixed_tokens > 0)
    g = torch.Generator().manual_seed(7)
    # prompts arrive while others decode, so most steps mix a prefill chunk with decode rows; the
    # longest prompt needs several chunks (a chunk after a prefix of its own)
    arrivals = {0: [5, 30], 3: [61, 9], 6: [17], 9: [44, 2, 26]}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    paths: Counter = Counter()
    step, n = 0, 0
    while e.has_work or step <= max(arrivals):
        for length in arrivals.get(step, ()):
            e.add_request(str(n), torch.randint(3, 250, (length,), generator=g).tolist(), params)
            n += 1
        for o in e.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        paths[e.runner.last_path] += 1
        step += 1
    assert e.stats().pool.active == 0
    return [out[str(i)] for i in range(n)], paths


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_graphs_equal_eager_mixed_steps(overlap):
    graphed, paths = _generate(96, overlap)
    eager, eager_paths = _generate(0, overlap)
    assert paths["mixed-graph"] >= 4 and eager_paths["mixed-graph"] == 0
    assert graphed == eager


def test_a_step_longer_than_the_largest_graph_runs_eagerly():
    e = LLMEngine(EngineConfig(model="dummy:tiny-llama", device="cuda", num_pages=256, page_size=4, max_running=8,
                               max_step_tokens=96, max_prefill_chunk=96, mixed_graph_max_tokens=64))
    assert e.runner.mixed_graphs.sizes[-1] == 64
    e.add_request("long", list(range(3, 83)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    e.step()
    assert e.runner.last_path == "eager"
    while e.has_work:
        e.step()


@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_16_bit_pages_take_the_wide_prefill_launch(page_size):
    """bf16: the chunk's keys come from the step (k_new) at every page size, the cached prefix by TMA
    where a page holds whole tiles; the engine's work lists follow that launch's block."""
    from kvshare_kernels.prefill_attention import default_launch
    from kvshare_kernels.prefill_tiles import tokens_per_tile

    launch = default_launch(page_size, torch.bfloat16, 16, torch.device("cuda"), new_kv=True)
    if launch.block_m != 128:
        pytest.skip("descriptors need Hopper or later")
    assert launch.tma == (page_size >= 64)
    e = LLMEngine(EngineConfig(model="dummy:tiny-llama", device="cuda", dtype="bfloat16", num_pages=32,
                               page_size=page_size, mixed_graph_max_tokens=96))
    assert e.runner.mixed_graphs.buffers.per_tile == tokens_per_tile(4, 2, launch.block_m)
    graphed, paths = _generate(96, True, page_size, "bfloat16", num_pages=32)
    eager, _ = _generate(0, True, page_size, "bfloat16", num_pages=32)
    assert paths["mixed-graph"] >= 4
    assert graphed == eager


def _first_logits(new_kv: bool, monkeypatch, model: str = "dummy:tiny-llama", page_copies: bool = False,
                  lengths: tuple[int, ...] = (7, 33, 100), chunk: int = 40) -> list[torch.Tensor]:
    monkeypatch.setenv("KVSHARE_PREFILL_NEW_KV", "1" if new_kv else "0")
    monkeypatch.setenv("KVSHARE_PREFILL_PAGE_COPIES", "1" if page_copies else "0")
    e = LLMEngine(EngineConfig(model=model, device="cuda", dtype="bfloat16", num_pages=128,
                               page_size=16, max_running=8, max_step_tokens=96, max_prefill_chunk=chunk))
    if e.runner.model.prefill_reads_new_kv(torch.bfloat16) != new_kv:
        pytest.skip("descriptors need Hopper or later")
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, return_generation_logits=True)
    # whole prompts, a prompt cut into chunks (the second chunk after a prefix of its own), a cache hit
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[2][:64] + [5, 6, 7])
    logits = {}
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, params)
        while e.has_work:
            for o in e.step():
                logits.setdefault(o.request_id, []).extend(o.generation_logits)
    return [logits[str(i)][0] for i in range(len(prompts))]


def test_prefill_from_the_steps_kv_matches_the_pool_path(monkeypatch):
    """The chunk's keys read from the step's K/V give the logits of reading them back from the
    pool, within bf16 rounding through the layers (other tile boundaries: not bit for bit; 0.13 on
    logits up to 22 on an H100). An unrotated or misplaced key would move them by whole units."""
    on, off = _first_logits(True, monkeypatch), _first_logits(False, monkeypatch)
    for a, b in zip(on, off):
        assert (a - b).abs().max() <= 0.02 * b.abs().max() + 0.05, ((a - b).abs().max(), b.abs().max())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU (Gluon TMA kernel)")
def test_page_copies_give_the_triton_launchs_logits(monkeypatch):
    """Hopper's default: prefix tiles at page 16 arrive by one bulk copy per page
    (prefill_pages_tma.py) inside the engine's graphs and work lists, with head_dim 128; the logits
    are the Triton launch's (KVSHARE_PREFILL_PAGE_COPIES=0) within bf16 rounding. Chunks of 96 after prefixes of up to 300 tokens
    make several whole and partial prefix tiles."""
    kw = dict(model="dummy:tiny-llama-hd128", lengths=(7, 200, 400), chunk=96)
    on, off = _first_logits(True, monkeypatch, page_copies=True, **kw), _first_logits(True, monkeypatch, **kw)
    for a, b in zip(on, off):
        assert (a - b).abs().max() <= 0.02 * b.abs().max() + 0.05, ((a - b).abs().max(), b.abs().max())
