"""rms_norm (with and without the fused residual add): Triton against the torch reference and the engine's norm."""

import os

import pytest
import torch

from kvshare.runtime.llama import rms_norm as engine_rms_norm
from kvshare_kernels import fused_norm, reference

# One ulp of the output dtype: the kernel sums the squares in another order than torch.
ULP = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(t, n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, n, generator=g) * 3).to(dtype).to(device)
    r = torch.randn(t, n, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(device)
    return x, r, w


@pytest.mark.parametrize("impl", [fused_norm, reference], ids=["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 96])   # 96: not a power of two (masked tail)
def test_rms_norm_matches_engine(impl, dtype, n, device):
    x, _, w = _inputs(5, n, dtype, device)
    out = impl.rms_norm(x, w, 1e-5)
    exp = engine_rms_norm(x.cpu(), w.cpu(), 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.cpu().float(), exp.float(), rtol=ULP[dtype], atol=ULP[dtype])


@pytest.mark.parametrize("impl", [fused_norm, reference], ids=["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_add_rms_norm_updates_residual_in_place(impl, dtype, device):
    x, r, w = _inputs(7, 64, dtype, device, seed=1)
    r_before = r.clone()
    out = impl.rms_norm(x, w, 1e-6, residual=r)
    summed = r_before.cpu() + x.cpu()                     # rounded to dtype, as the engine's `residual + h`
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        # the interpreter truncates to bf16 where the GPU rounds: 1 ulp
        torch.testing.assert_close(r.cpu(), summed, rtol=ULP[dtype], atol=ULP[dtype])
    else:
        assert torch.equal(r.cpu(), summed)               # the sum itself is rounded once, like torch's
    exp = engine_rms_norm(summed, w.cpu(), 1e-6)
    torch.testing.assert_close(out.cpu().float(), exp.float(), rtol=ULP[dtype], atol=ULP[dtype])


def test_rms_norm_strided_rows_and_out(device):
    # x as every other row of a wider buffer (row stride > N); a preallocated out
    base = torch.randn(6, 2, 32, device=device)
    x = base[:, 1]
    w = torch.rand(32, device=device) + 0.5
    out = torch.empty(6, 32, device=device)
    got = fused_norm.rms_norm(x, w, 1e-5, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.cpu(), engine_rms_norm(x.cpu(), w.cpu(), 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_empty_and_bad_shapes(device):
    w = torch.ones(16, device=device)
    assert fused_norm.rms_norm(torch.empty(0, 16, device=device), w, 1e-5).shape == (0, 16)
    with pytest.raises(ValueError):
        fused_norm.rms_norm(torch.ones(2, 8, device=device), w, 1e-5)
    with pytest.raises(ValueError):
        fused_norm.rms_norm(torch.ones(2, 16, device=device), w, 1e-5, residual=torch.ones(3, 16, device=device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs CUDA (compiled Triton)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 256, 4096])
def test_add_rms_norm_full_size_gpu(dtype, t):
    x, r, w = _inputs(t, 4096, dtype, "cuda", seed=t)
    r_ref = r.clone()
    out = fused_norm.rms_norm(x, w, 1e-5, residual=r)
    exp = reference.rms_norm(x, w, 1e-5, residual=r_ref)
    assert torch.equal(r, r_ref)
    torch.testing.assert_close(out.float(), exp.float(), rtol=ULP[dtype], atol=ULP[dtype])
