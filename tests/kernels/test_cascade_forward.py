"""The Llama forward with cascade decode attention (rows sharing prefix pages) against the plain decode.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors: this checks runtime wiring (the planner's
choice, ForwardBatch.cascade, llama._attention) in CI; on a GPU it runs compiled.
"""

import pytest
import torch

import kvshare_kernels.kernels as triton_ops
from kvshare.runtime.cascade_planner import CascadePolicy, plan_shared_prefixes
from kvshare.runtime.forward_batch import build_forward_batch
from kvshare.runtime.kv_cache import KVCache
from kvshare.runtime.llama import LlamaModel
from kvshare.runtime.model_config import NAMED_CONFIGS
from kvshare.runtime.weights import random_weights

PAGE = 4
POLICY = CascadePolicy(min_saved_fraction=0.25, min_batch=2, min_shared_pages=2, min_plain_read_gb=0.0)
KVB = 1024   # K+V bytes per token (irrelevant with min_plain_read_gb=0)


def test_planner_skips_batches_without_common_pages():
    rows = [((1, 2, 3), 10), ((4, 5, 6), 10), ((7, 8, 9), 10)]
    assert plan_shared_prefixes(rows, PAGE, torch.device("cpu"), POLICY, KVB) is None


def test_planner_skips_small_savings_and_small_batches():
    shared = (1, 2)
    rows = [(shared + tuple(range(10 + 20 * i, 30 + 20 * i)), 88) for i in range(3)]   # 8 of 88 tokens shared
    assert plan_shared_prefixes(rows, PAGE, torch.device("cpu"), POLICY, KVB) is None
    one = [((1, 2, 3, 4), 15)]
    assert plan_shared_prefixes(one, PAGE, torch.device("cpu"), POLICY, KVB) is None


def test_planner_groups_rows_with_a_long_common_prefix():
    shared = (1, 2, 3, 4)
    rows = [(shared + (10 + i,), 18) for i in range(5)] + [((50, 51, 52), 10)]
    plan = plan_shared_prefixes(rows, PAGE, torch.device("cpu"), POLICY, KVB)
    assert plan is not None and plan.num_groups == 1
    assert plan.row_shared_len.tolist() == [16] * 5 + [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cascade_forward_matches_plain_decode(dtype, device):
    device = torch.device(device)
    config = NAMED_CONFIGS["tiny-llama"]
    weights = random_weights(config, dtype=dtype, device=device, seed=3)
    model = LlamaModel(config, weights, device=torch.device("cpu"), dtype=dtype, ops=triton_ops)
    model.rope.cos, model.rope.sin = model.rope.cos.to(device), model.rope.sin.to(device)
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 250, (12,), generator=g).tolist()          # 3 full shared pages
    prompts = [system + torch.randint(3, 250, (n,), generator=g).tolist() for n in (2, 5, 3, 6)]
    shared_pages = [0, 1, 2]
    tables = [shared_pages + [3 + 3 * i, 4 + 3 * i, 5 + 3 * i] for i in range(len(prompts))]
    kv = KVCache.allocate(config, num_pages=20, page_size=PAGE, dtype=dtype, device=device)
    # Prefill: the shared pages once (first request), then each request's own tokens.
    model.forward(build_forward_batch([(prompts[0], 0, tables[0], True)], PAGE, device), kv)
    model.forward(build_forward_batch([(p[12:], 12, t, True) for p, t in zip(prompts[1:], tables[1:])],
                                      PAGE, device), kv)
    decode = [([p[-1] + 1], len(p), t, True) for p, t in zip(prompts, tables)]
    plan = plan_shared_prefixes([(t, len(p) + 1) for p, t in zip(prompts, tables)], PAGE, device, POLICY, KVB)
    assert plan is not None and plan.num_groups == 1
    plain = model.forward(build_forward_batch(decode, PAGE, device), kv)
    cascade_batch = build_forward_batch(decode, PAGE, device, cascade=plan)
    assert cascade_batch.cascade is plan
    cascaded = model.forward(cascade_batch, kv)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cascaded, plain, rtol=tol, atol=tol)


def test_planner_leaves_small_reads_to_the_decode_graph():
    shared = (1, 2, 3, 4)
    rows = [(shared + (10 + i,), 18) for i in range(5)]
    strict = CascadePolicy(min_saved_fraction=0.25, min_batch=2, min_shared_pages=2, min_plain_read_gb=1.0)
    assert plan_shared_prefixes(rows, PAGE, torch.device("cpu"), strict, 524288) is None        # 47 MB of KV
    assert plan_shared_prefixes(rows, PAGE, torch.device("cpu"), strict, 2**30) is not None     # 90 GB of KV
