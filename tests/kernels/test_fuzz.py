"""Random configurations: fresh inputs, lengths, page sizes, heads, splits and tiles for every draw."""

import random

import pytest
import torch

from kvshare_kernels import kernels
from paged_cases import TOL, dense_attention, make_case, rel_err


@pytest.mark.parametrize("seed", range(8))
def test_decode_and_prefill_random(seed, device):
    rnd = random.Random(seed)
    page_size = rnd.choice([1, 2, 4, 8, 16, 32])
    hkv = rnd.choice([1, 2])
    hq = hkv * rnd.choice([1, 2, 3, 4])
    d = rnd.choice([16, 32])
    block_n = rnd.choice([16, 32])
    lens = [rnd.randint(1, 70) for _ in range(rnd.randint(1, 4))]
    case = make_case(lens, page_size, hkv, d, torch.float32, device, seed=seed, share=rnd.random() < 0.7)
    scale = d ** -0.5
    q = torch.randn(len(lens), hq, d, device=device)
    out = kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, scale,
                                         num_splits=rnd.randint(1, 5), block_n=block_n)
    for i in range(len(lens)):
        assert rel_err(out[i], dense_attention(q[i : i + 1], case.dense_k[i], case.dense_v[i], scale)[0]) < TOL[torch.float32]
    q_lens = [rnd.randint(0, n) for n in lens]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    qp = torch.randn(sum(q_lens), hq, d, device=device)
    outp = kernels.paged_prefill_attention(qp, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens,
                                           scale, block_m=rnd.choice([16, 32]), block_n=block_n)
    for i, m in enumerate(q_lens):
        s = int(qsl[i])
        if m:
            ref = dense_attention(qp[s : s + m], case.dense_k[i], case.dense_v[i], scale)
            assert rel_err(outp[s : s + m], ref) < TOL[torch.float32], (seed, i)
