"""The Llama forward with the fused kernels (as on CUDA) against the torch path (as on the CPU).

Under TRITON_INTERPRET=1 the fused kernels run on CPU tensors, so this checks the wiring in
runtime/llama.py (residual stream updated in place, q rotated in the qkv buffer and rotated k/v written to the
pool in one kernel, silu*up, final norm)
in CI; on a GPU the same test runs compiled.
"""

import pytest
import torch

from kvshare.runtime.forward_batch import build_forward_batch
from kvshare.runtime.kv_cache import KVCache
from kvshare.runtime.llama import LlamaModel
from kvshare.runtime.model_config import NAMED_CONFIGS
from kvshare.runtime.weights import random_weights
from kvshare_kernels import fused_norm, fused_rotary, fused_silu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_forward_matches_torch_path(dtype, device):
    device = torch.device(device)
    config = NAMED_CONFIGS["tiny-llama"]
    weights = random_weights(config, dtype=dtype, device=device, seed=2)
    torch_model = LlamaModel(config, weights, device=torch.device("cpu"), dtype=dtype)
    torch_model.rope.cos, torch_model.rope.sin = torch_model.rope.cos.to(device), torch_model.rope.sin.to(device)
    torch_model.fused = False
    fused_model = LlamaModel(config, weights, device=torch.device("cpu"), dtype=dtype)
    fused_model.rope.cos, fused_model.rope.sin = fused_model.rope.cos.to(device), fused_model.rope.sin.to(device)
    fused_model.fused = True
    fused_model._fused_rms_norm, fused_model._fused_rotary_write_kv = fused_norm.rms_norm, fused_rotary.rotary_write_kv
    fused_model._fused_silu_mul = fused_silu.silu_and_mul
    for model in (torch_model, fused_model):   # built for the CPU, whose float32 linears are oneDNN's
        model._linear = torch.nn.functional.linear

    page_size = 4
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (6, 9)]
    tables = [[3, 8, 1], [5, 0, 7]]
    logits = []
    for model in (torch_model, fused_model):
        kv = KVCache.allocate(config, num_pages=10, page_size=page_size, dtype=dtype, device=device)
        prefill = model.forward(build_forward_batch([(p, 0, t, True) for p, t in zip(prompts, tables)],
                                                    page_size, device), kv)
        decode = model.forward(build_forward_batch([([p[-1] + 1], len(p), t, True) for p, t in zip(prompts, tables)],
                                                   page_size, device), kv)
        logits.append((prefill, decode))
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(*logits):
        assert a.shape == b.shape == (2, config.vocab_size)
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)
