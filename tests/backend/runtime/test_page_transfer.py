"""The tier byte movers: PageTransfer (GPU page <-> host slot, every page tensor, runs of consecutive
slots; the same code on the CPU without a stream), DiskStore (atomic, checksummed page files with a
layout fingerprint) and DiskIO (background jobs, one key's jobs in order). CUDA tests (the copy
stream, events, and the engine's restart from disk on the GPU) skip without CUDA."""
from __future__ import annotations

import os

import pytest
import torch

from kvshare.core.types import DiskRead, DiskWrite
from kvshare.runtime.disk_io import DiskIO
from kvshare.runtime.disk_store import DiskStore, layout_fingerprint
from kvshare.runtime.kv_cache import KVCache
from kvshare.runtime.model_config import NAMED_CONFIGS
from kvshare.runtime.page_transfer import PageTransfer, slot_runs

TINY = NAMED_CONFIGS["tiny-llama"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cache(device: str, dtype=torch.float32) -> KVCache:
    kv = KVCache.allocate(TINY, num_pages=12, page_size=4, dtype=dtype, device=torch.device(device), host_pages=8)
    g = torch.Generator().manual_seed(3)
    for t in kv.page_tensors():
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return kv


def test_slot_runs():
    assert slot_runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]
    assert slot_runs([7]) == [(0, 7, 1)] and slot_runs([]) == []


def check_moves(kv: KVCache, transfer: PageTransfer) -> None:
    spills = [(2, 5), (7, 6), (3, 0), (11, 7)]                    # slots 5,6,7 one run; 0 apart
    before = [t.clone().cpu() for t in kv.page_tensors()]
    transfer.run(spills, [])
    loads = [(6, 1), (0, 4), (5, 9)]                               # back into other pages
    transfer.run([], loads)
    if transfer.done is not None:
        torch.cuda.current_stream().synchronize()
    for src, slots, dst in zip(before, kv.host_page_tensors(), kv.page_tensors()):
        for page, slot in spills:
            assert torch.equal(slots[slot], src[page])
        for slot, page in loads:
            assert torch.equal(dst[page].cpu(), slots[slot])


def test_page_moves_on_the_cpu_cover_every_page_tensor():
    kv = cache("cpu")
    transfer = PageTransfer(kv, torch.device("cpu"))
    assert transfer.stream is None and len(transfer.pages) == 2 * TINY.num_layers
    check_moves(kv, transfer)
    assert transfer.done is None


@pytest.mark.gpu
@cuda
def test_page_moves_on_a_copy_stream():
    kv = cache("cuda", torch.float16)
    transfer = PageTransfer(kv, torch.device("cuda"))
    assert transfer.stream is not None
    check_moves(kv, transfer)
    assert transfer.done is not None and transfer.done.query()


@pytest.mark.gpu
@cuda
def test_a_forward_after_a_spill_cannot_overwrite_the_page_before_it_is_gathered():
    kv = cache("cuda", torch.float16)
    transfer = PageTransfer(kv, torch.device("cuda"))
    want = [t[4].clone() for t in kv.page_tensors()]
    torch.cuda._sleep(50_000_000)                                  # the compute stream is busy for a while
    transfer.run([(4, 2)], [])
    for t in kv.page_tensors():
        t[4].fill_(7)                                              # "the next forward" writes the reused page
    transfer.done.synchronize()
    for w, slots in zip(want, kv.host_page_tensors()):
        assert torch.equal(slots[2], w.cpu())


def store(tmp_path, fingerprint="f00d") -> DiskStore:
    return DiskStore(tmp_path, fingerprint, use_kvikio=False)


def page(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 2, 16, generator=g).to(dtype) for _ in range(4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_round_trip_and_scan(tmp_path, dtype):
    s = store(tmp_path)
    s.write(b"\x01" * 16, b"\x02" * 16, b"salt", (5, 6, 7, 8), page(1, dtype))
    out = [torch.zeros(4, 2, 16, dtype=dtype) for _ in range(4)]
    assert s.read_into(b"\x01" * 16, out)
    assert all(torch.equal(a, b) for a, b in zip(out, page(1, dtype)))
    (found,) = s.scan()
    assert (found.key, found.parent_key, found.salt, found.tokens) == (b"\x01" * 16, b"\x02" * 16, b"salt", (5, 6, 7, 8))
    assert not list(s.dir.glob("*.tmp"))


def test_store_misses_on_flipped_truncated_foreign_and_missing_files(tmp_path):
    s = store(tmp_path)
    out = [torch.zeros(4, 2, 16) for _ in range(4)]
    for i in range(3):
        s.write(bytes([i]) * 16, b"p" * 16, b"", (i,), page(i))
    flipped, truncated, foreign = (s.path(bytes([i]) * 16) for i in range(3))
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 1
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-1])
    assert not s.read_into(bytes([0]) * 16, out) and not s.read_into(bytes([1]) * 16, out)
    other = store(tmp_path, "beef")                                # another layout's directory
    os.replace(foreign, other.path(bytes([2]) * 16))
    assert not other.read_into(bytes([2]) * 16, out)               # its header names the other layout
    assert not other.scan() and not other.path(bytes([2]) * 16).exists()
    assert not s.read_into(b"\x09" * 16, out)                      # no file
    assert not s.read_into(bytes([0]) * 16, [torch.zeros(4, 2, 8) for _ in range(4)])   # another page shape
    (s.dir / "x.kvpage.123.tmp").write_bytes(b"half")              # a crash mid-write
    assert [p.key for p in s.scan()] == [bytes([0]) * 16]          # the truncated one and the tmp are gone
    assert not (s.dir / "x.kvpage.123.tmp").exists()


def test_fingerprint_names_the_layout():
    kv = cache("cpu")
    base = layout_fingerprint("dummy:tiny-llama", TINY, kv.host_page_tensors(), 4, "blake2b_128")
    assert base == layout_fingerprint("dummy:tiny-llama", TINY, kv.host_page_tensors(), 4, "blake2b_128")
    half = KVCache.allocate(TINY, num_pages=2, page_size=4, dtype=torch.float16, device=torch.device("cpu"),
                            host_pages=2)
    assert base != layout_fingerprint("dummy:tiny-llama", TINY, half.host_page_tensors(), 4, "blake2b_128")
    assert base != layout_fingerprint("dummy:tiny-llama", TINY, kv.host_page_tensors(), 8, "blake2b_128")
    assert base != layout_fingerprint("dummy:other", TINY, kv.host_page_tensors(), 4, "blake2b_128")


def test_disk_io_runs_jobs_off_the_caller_and_keeps_one_keys_order(tmp_path):
    kv = cache("cpu")
    s = store(tmp_path)
    io = DiskIO(s, kv.host_page_tensors(), workers=2)
    key = b"\x05" * 16
    io.submit([DiskWrite(key, 3, b"p" * 16, b"", (1, 2, 3, 4))], [], [], None)
    assert io.flush(30)
    ((job, is_write, ok),) = io.poll()
    assert ok and is_write and job.key == key and io.poll() == []
    io.submit([DiskWrite(key, 4, b"p" * 16, b"", (1, 2, 3, 4))], [DiskRead(key, 6)], [key], None)   # delete first
    assert io.flush(30)
    done = io.poll()
    assert [(type(j).__name__, w) for j, w, _ in done] == [("DiskWrite", True), ("DiskRead", False)]
    assert all(ok for _, _, ok in done)
    for slots in kv.host_page_tensors():
        assert torch.equal(slots[6], slots[4])                     # the read saw the rewrite, not a deleted file
    io.submit([], [DiskRead(b"\x06" * 16, 1)], [], None)
    assert io.flush(30) and io.poll()[0][2] is False
    io.close()
    assert io.bytes_written == 2 * kv.host_page_bytes and io.bytes_read == kv.host_page_bytes


@pytest.mark.gpu
@cuda
def test_engine_restart_from_disk_on_cuda(tmp_path):
    from kvshare.engine.engine import LLMEngine
    from kvshare.engine.engine_config import EngineConfig
    from kvshare.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(9)
    a = torch.randint(3, 250, (29,), generator=g).tolist()
    b = torch.randint(3, 250, (40,), generator=g).tolist()

    def engine(num_pages: int, disk: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(model="dummy:tiny-llama", device="cuda", dtype="float16", num_pages=num_pages,
                                      page_size=4, max_running=2, max_step_tokens=32, max_prefill_chunk=16,
                                      debug_checks=True, host_cache_memory_gb=0.001 if disk else 0.0,
                                      disk_cache_dir=str(tmp_path) if disk else "", disk_cache_gb=0.01))

    def run(e: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
        e.add_request(str(len(prompt)) + str(e.stats().prompt_tokens_total), prompt,
                      SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        tokens, cached = [], -1
        while e.has_work:
            for out in e.step():
                tokens += list(out.token_ids)
                cached = out.cached_tokens if out.finished else cached
        return tokens, cached

    roomy = engine(64, False)
    run(roomy, a)
    want, hit = run(roomy, a)          # the same shapes as below: 28 tokens cached, the last one computed
    assert hit == 28
    first = engine(12, True)
    for prompt in (a, a, b):
        run(first, prompt)
    first.close()
    again = engine(12, True)
    tokens, cached = run(again, a)
    again.close()
    assert cached == 28 and tokens == want and again.stats().pool.disk_hits_tokens_total == 28
