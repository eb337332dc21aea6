"""The disk tier through the engine on the CPU (real files, real page copies, tiny random model): pages
a small pool evicts are written through the host tier to files; a new engine on the same directory
(a restart) serves the prompt from them with the tokens of a run whose pages never left the device;
a corrupted or truncated file is a miss (recomputed, same tokens), never wrong KV; the files stay
within the budget."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.runtime.disk_store import SUFFIX
from kvshare.sampling_params import SamplingParams

PAGE = 4
_g = torch.Generator().manual_seed(9)
PROMPT_A = torch.randint(3, 250, (29,), generator=_g).tolist()   # 7 full pages + its last token
PROMPT_B = torch.randint(3, 250, (40,), generator=_g).tolist()   # + 6 new tokens: all 12 pages of the pool


def make_engine(disk_dir: Path | None, *, num_pages: int = 12, disk_gb: float = 0.01, overlap: bool = False,
                host_gb: float = 0.001) -> LLMEngine:
    return LLMEngine(EngineConfig(model="dummy:tiny-llama", num_pages=num_pages, page_size=PAGE, max_running=2,
                                  max_step_tokens=32, max_prefill_chunk=16, debug_checks=True,
                                  host_cache_memory_gb=host_gb if disk_dir is not None else 0.0,
                                  disk_cache_dir=str(disk_dir) if disk_dir is not None else "",
                                  disk_cache_gb=disk_gb, overlap_schedule=overlap))


def run(engine: LLMEngine, prompt: list[int], rid: str) -> tuple[list[int], int]:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    tokens, cached = [], -1
    while engine.has_work:
        for out in engine.step():
            tokens += list(out.token_ids)
            if out.finished:
                cached = out.cached_tokens
    engine.check_integrity()
    return tokens, cached


def fill_disk(disk_dir: Path, **kw) -> LLMEngine:
    """A twice (shared: worth keeping), then B, which evicts every page of A into the tiers."""
    engine = make_engine(disk_dir, **kw)
    for i, prompt in enumerate((PROMPT_A, PROMPT_A, PROMPT_B)):
        run(engine, prompt, f"fill{i}")
    engine.close()
    return engine


def page_files(disk_dir: Path) -> list[Path]:
    return sorted(disk_dir.glob(f"*/*{SUFFIX}"))


def key_file(engine: LLMEngine, disk_dir: Path, page: int) -> Path:
    key = engine.scheduler.kv.page_keys(PROMPT_A, b"")[page]
    (path,) = [p for p in page_files(disk_dir) if p.name == key.hex() + SUFFIX]
    return path


@pytest.fixture(scope="module")
def cold() -> tuple[list[int], int]:
    """A's tokens from an engine whose pages never left the device."""
    return run(make_engine(None, num_pages=64), PROMPT_A, "cold")


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_restart_serves_the_prompt_from_disk(tmp_path, cold, overlap):
    first = fill_disk(tmp_path, overlap=overlap)
    written = first.stats().pool.disk_writes_total
    assert written >= 7 and len(page_files(tmp_path)) == written            # A's 7 full pages at least
    restarted = make_engine(tmp_path, overlap=overlap)
    assert restarted.stats().pool.disk_pages_used == written                  # the warm index
    tokens, cached = run(restarted, PROMPT_A, "again")
    pool = restarted.stats().pool
    assert cached == 28 and pool.disk_hits_tokens_total == 28                 # every full page from disk
    assert pool.disk_reads_total == 7 and pool.faults_gpu_total == 7 and pool.faults_disk_total == 0
    assert (tokens, cached) == (cold[0], 28)
    restarted.close()


def test_a_hot_prompt_that_never_left_the_gpu_survives_a_restart(tmp_path, cold):
    first = make_engine(tmp_path, num_pages=64)                               # roomy: nothing is evicted
    run(first, PROMPT_A, "a")
    assert first.stats().pool.disk_writes_total == 0                          # not shared yet: not worth a file
    run(first, PROMPT_A, "shared")                                            # shared: backed up while cached
    first.close()
    pool = first.stats().pool
    assert pool.evictions_total == 0 and pool.disk_writes_total == 7
    restarted = make_engine(tmp_path, num_pages=64)
    assert run(restarted, PROMPT_A, "again") == (cold[0], 28)
    restarted.close()


def test_corrupted_and_truncated_files_are_misses(tmp_path, cold):
    first = fill_disk(tmp_path)
    flipped, truncated = key_file(first, tmp_path, 3), key_file(first, tmp_path, 5)
    data = bytearray(flipped.read_bytes())
    data[-10] ^= 0xFF                                                         # inside the KV body
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-7])
    restarted = make_engine(tmp_path)
    assert restarted.stats().pool.disk_pages_used == len(page_files(tmp_path))
    assert not truncated.exists()                                             # torn: dropped at the scan
    tokens, cached = run(restarted, PROMPT_A, "again")
    pool = restarted.stats().pool
    assert cached == 3 * PAGE                                                 # pages 0-2; page 3 failed its checksum
    assert pool.disk_read_failures_total == 1 and pool.disk_hits_tokens_total == 3 * PAGE
    assert tokens == cold[0]                                                  # recomputed, the same tokens
    restarted.close()
    assert not flipped.exists()                                               # a bad file is deleted


def test_another_layout_never_reads_these_files(tmp_path, cold):
    fill_disk(tmp_path)
    other = LLMEngine(EngineConfig(model="dummy:tiny-llama", num_pages=12, page_size=PAGE, max_running=2,
                                   max_step_tokens=32, max_prefill_chunk=16, debug_checks=True, seed=1,
                                   host_cache_memory_gb=0.001, disk_cache_dir=str(tmp_path), disk_cache_gb=0.01))
    assert other.stats().pool.disk_pages_used == 0                             # other weights: other fingerprint
    _, cached = run(other, PROMPT_A, "other")
    assert cached == 0
    other.close()


def test_files_stay_within_the_budget(tmp_path):
    probe = make_engine(tmp_path, disk_gb=0.01)
    budget_pages = 3
    gb = budget_pages * probe.kv.host_page_bytes / 2**30
    probe.close()
    engine = make_engine(tmp_path, disk_gb=gb)
    assert engine.stats().pool.disk_pages_total == budget_pages
    for i, prompt in enumerate((PROMPT_A, PROMPT_A, PROMPT_B, PROMPT_B, PROMPT_A)):
        run(engine, prompt, f"r{i}")
    engine.close()
    pool = engine.stats().pool
    assert pool.disk_writes_total > budget_pages and pool.disk_evictions_total > 0
    assert len(page_files(tmp_path)) <= budget_pages == pool.disk_pages_used


def test_disk_tier_needs_a_host_tier(tmp_path):
    with pytest.raises(ValueError, match="host_cache_memory_gb"):
        LLMEngine(EngineConfig(model="dummy:tiny-llama", num_pages=12, page_size=PAGE, disk_cache_dir=str(tmp_path)))
