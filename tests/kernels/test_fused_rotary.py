"""rotary_embedding: Triton against the torch reference and the engine's RotaryEmbedding (rotate-half)."""

import pytest
import torch

from kvshare.runtime.model_config import ModelConfig
from kvshare.runtime.rotary import RotaryEmbedding
from kvshare_kernels import fused_rotary, reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _qkv(t, hq, hkv, d, dtype, device, seed=0):
    """q, k as strided views of one fused projection [T, (Hq + 2 Hkv) * D], like the engine's."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return qkv, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def _rope(d, dtype, device, max_position=64):
    """The engine's RotaryEmbedding (default rope) for head dim d, tables in dtype on device."""
    config = ModelConfig(num_layers=1, hidden_size=4 * d, intermediate_size=8, num_heads=4, num_kv_heads=2,
                         head_dim=d, vocab_size=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=max_position,
                         tie_word_embeddings=False)
    return RotaryEmbedding(config, torch.device(device), dtype)


@pytest.mark.parametrize("impl", [fused_rotary, reference], ids=["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (3, 3, 24)])   # GQA; odd heads, D/2 not a power of two
def test_rotary_matches_engine(impl, dtype, pos_dtype, hq, hkv, d, device):
    t = 6
    rope = _rope(d, dtype, device)
    qkv, q, k, v = _qkv(t, hq, hkv, d, dtype, device)
    v_before = v.clone()
    positions = torch.tensor([0, 5, 63, 1, 17, 5], dtype=pos_dtype, device=device)
    # The engine's torch path rounds in dtype after each op; the kernels round once: compare both
    # with the engine's rotation in fp32 of the same inputs and the same (dtype) tables.
    rope32 = _rope(d, torch.float32, "cpu")
    rope32.cos, rope32.sin = rope.cos.cpu().float(), rope.sin.cpu().float()
    exp_q, exp_k = rope32(positions.cpu(), q.cpu().float(), k.cpu().float())
    got_q, got_k = impl.rotary_embedding(q, k, rope.cos, rope.sin, positions)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()      # in place
    torch.testing.assert_close(q.cpu().float(), exp_q.float(), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(k.cpu().float(), exp_k.float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(v, v_before)                                                     # v untouched


def test_rotary_triton_equals_reference(device):
    # both compute in fp32 and round once: equal up to fp32 rounding of the products
    dtype = torch.float16
    rope = _rope(32, dtype, device)
    _, q1, k1, _ = _qkv(9, 4, 1, 32, dtype, device, seed=3)
    _, q2, k2, _ = _qkv(9, 4, 1, 32, dtype, device, seed=3)
    positions = torch.arange(9, dtype=torch.int32, device=device) * 7
    fused_rotary.rotary_embedding(q1, k1, rope.cos, rope.sin, positions)
    reference.rotary_embedding(q2, k2, rope.cos, rope.sin, positions)
    torch.testing.assert_close(q1, q2, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(k1, k2, rtol=1e-3, atol=1e-3)


def test_rotary_empty_and_bad_args(device):
    rope = _rope(16, torch.float32, device)
    _, q, k, _ = _qkv(0, 2, 1, 16, torch.float32, device)
    fused_rotary.rotary_embedding(q, k, rope.cos, rope.sin, torch.empty(0, dtype=torch.int32, device=device))
    _, q, k, _ = _qkv(2, 2, 1, 16, torch.float32, device)
    with pytest.raises(ValueError):
        fused_rotary.rotary_embedding(q, k, rope.cos, rope.sin, torch.zeros(2, dtype=torch.float32, device=device))
    with pytest.raises(ValueError):
        fused_rotary.rotary_embedding(q, k[:, :, :8], rope.cos, rope.sin, torch.zeros(2, dtype=torch.int32, device=device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1",
                    reason="needs CUDA (compiled Triton)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,hq,hkv", [(1, 32, 32), (256, 32, 32), (4096, 32, 8)])   # Llama-2-7B, Llama-3-8B
def test_rotary_full_size_gpu(dtype, t, hq, hkv):
    d = 128
    rope = _rope(d, dtype, "cuda", max_position=4096)
    _, q1, k1, _ = _qkv(t, hq, hkv, d, dtype, "cuda", seed=t)
    _, q2, k2, _ = _qkv(t, hq, hkv, d, dtype, "cuda", seed=t)
    positions = torch.randint(0, 4096, (t,), device="cuda", dtype=torch.int32)
    fused_rotary.rotary_embedding(q1, k1, rope.cos, rope.sin, positions)
    reference.rotary_embedding(q2, k2, rope.cos, rope.sin, positions.long())
    torch.testing.assert_close(q1.float(), q2.float(), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(k1.float(), k2.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("hq,hkv,d,page_size", [(4, 2, 16, 4), (3, 3, 24, 1), (8, 1, 32, 16)])
def test_rotary_write_kv_equals_rotary_then_write_kv(dtype, pos_dtype, hq, hkv, d, page_size, device):
    """The fused kernel against the two kernels it replaces, bit for bit: same q, same pool, slot -1
    rows write nothing, k and v (views of the projection) are left as they were."""
    t, num_pages = 7, 8
    rope = _rope(d, dtype, device)
    g = torch.Generator().manual_seed(hq * d + page_size)
    positions = torch.tensor([0, 5, 63, 1, 17, 5, 40], dtype=pos_dtype, device=device)
    slots = torch.randperm(num_pages * page_size, generator=g)[:t].to(torch.int32)
    slots[[1, 4]] = -1
    slots = slots.to(device)
    pool = torch.randn(2, num_pages, page_size, hkv, d, generator=g).to(dtype).to(device)

    _, q1, k1, v1 = _qkv(t, hq, hkv, d, dtype, device, seed=11)
    kc1, vc1 = pool[0].clone(), pool[1].clone()
    fused_rotary.rotary_embedding(q1, k1, rope.cos, rope.sin, positions)
    from kvshare_kernels import kv_write
    kv_write.write_kv(k1, v1, kc1, vc1, slots)

    qkv2, q2, k2, v2 = _qkv(t, hq, hkv, d, dtype, device, seed=11)
    k_before, v_before = k2.clone(), v2.clone()
    kc2, vc2 = pool[0].clone(), pool[1].clone()
    got = fused_rotary.rotary_write_kv(q2, k2, v2, rope.cos, rope.sin, positions, kc2, vc2, slots)

    assert got.data_ptr() == q2.data_ptr()
    assert torch.equal(q2, q1)
    assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1)
    assert torch.equal(k2, k_before) and torch.equal(v2, v_before)      # read only
    skipped = slots.cpu() < 0
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool)
    untouched[slots.cpu()[~skipped].long()] = False
    assert torch.equal(kc2.view(-1, hkv, d)[untouched.to(device)], pool[0].view(-1, hkv, d)[untouched.to(device)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_k_in_place(dtype, device):
    """k_in_place: the same q and pool as without it, and k rotated in place as rotary_embedding
    rotates it (every token, slot -1 too), bit for bit; v untouched."""
    t, hq, hkv, d, page_size, num_pages = 7, 4, 2, 16, 4, 8
    rope = _rope(d, dtype, device)
    positions = torch.tensor([0, 5, 63, 1, 17, 5, 40], dtype=torch.int32, device=device)
    slots = torch.tensor([3, -1, 9, 0, -1, 30, 12], dtype=torch.int32, device=device)
    pools = [torch.zeros(num_pages, page_size, hkv, d, dtype=dtype, device=device) for _ in range(4)]
    _, q1, k1, v1 = _qkv(t, hq, hkv, d, dtype, device, seed=5)
    fused_rotary.rotary_write_kv(q1, k1, v1, rope.cos, rope.sin, positions, pools[0], pools[1], slots)
    _, q2, k2, v2 = _qkv(t, hq, hkv, d, dtype, device, seed=5)
    v_before = v2.clone()
    fused_rotary.rotary_write_kv(q2, k2, v2, rope.cos, rope.sin, positions, pools[2], pools[3], slots, k_in_place=True)
    _, q3, k3, _ = _qkv(t, hq, hkv, d, dtype, device, seed=5)
    fused_rotary.rotary_embedding(q3, k3, rope.cos, rope.sin, positions)
    assert torch.equal(q2, q1) and torch.equal(pools[2], pools[0]) and torch.equal(pools[3], pools[1])
    assert torch.equal(k2, k3) and torch.equal(v2, v_before)
    kept = slots.cpu() >= 0
    assert torch.equal(pools[2].view(-1, hkv, d)[slots[kept.to(device)].long()], k2[kept.to(device)])


def test_rotary_write_kv_rejects_bad_shapes(device):
    rope = _rope(16, torch.float32, device)
    _, q, k, v = _qkv(3, 4, 2, 16, torch.float32, device)
    cache = torch.zeros(4, 4, 2, 16, device=device)
    pos = torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        fused_rotary.rotary_write_kv(q, k, v, rope.cos, rope.sin, pos, cache, cache.clone(),
                                     torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="must be \\[T, 3, 16\\]"):
        fused_rotary.rotary_write_kv(q, k, v, rope.cos, rope.sin, pos, torch.zeros(4, 4, 3, 16, device=device),
                                     torch.zeros(4, 4, 3, 16, device=device), torch.zeros(3, dtype=torch.int32, device=device))
