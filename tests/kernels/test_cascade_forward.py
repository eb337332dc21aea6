"""The Llama forward with cascade decode attention (rows sharing prefix pages) against the plain decode.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors: this checks runtime wiring (the planner's
choice, ForwardBatch.cascade, llama._attention) in CI; on a GPU it runs compiled.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvshare_kernels.kernels as triton_ops
from kvshare.runtime.cascade_planner import CascadePolicy, plan_shared_prefixes
from kvshare.runtime.forward_batch import build_forward_batch
from kvshare.runtime.input_buffers import CascadePlanBuffers, DecodeInputBuffers, max_groups
from kvshare.runtime.kv_cache import KVCache
from kvshare.runtime.llama import LlamaModel
from kvshare.runtime.model_config import NAMED_CONFIGS
from kvshare.runtime.weights import random_weights

PAGE = 4
POLICY = CascadePolicy(min_saved_fraction=0.25, min_batch=2, min_shared_pages=2, min_plain_read_gb=0.0,
                       min_saved_read_gb_graph=0.0)
KVB = 1024   # K+V bytes per token (irrelevant with the two byte thresholds at 0)


def test_planner_skips_batches_without_common_pages():
    rows = [((1, 2, 3), 10), ((4, 5, 6), 10), ((7, 8, 9), 10)]
    assert plan_shared_prefixes(rows, PAGE, POLICY, KVB) is None


def test_planner_skips_small_savings_and_small_batches():
    shared = (1, 2)
    rows = [(shared + tuple(range(10 + 20 * i, 30 + 20 * i)), 88) for i in range(3)]   # 8 of 88 tokens shared
    assert plan_shared_prefixes(rows, PAGE, POLICY, KVB) is None
    one = [((1, 2, 3, 4), 15)]
    assert plan_shared_prefixes(one, PAGE, POLICY, KVB) is None


def test_planner_groups_rows_with_a_long_common_prefix():
    shared = (1, 2, 3, 4)
    rows = [(shared + (10 + i,), 18) for i in range(5)] + [((50, 51, 52), 10)]
    plan = plan_shared_prefixes(rows, PAGE, POLICY, KVB)
    assert plan is not None and plan.num_groups == 1
    assert plan.row_shared_len.tolist() == [16] * 5 + [0]


def _prefilled_shared_prefix(dtype, device, *, seed: int, system_pages: int, suffixes: tuple[int, ...]):
    """A tiny model and a cache holding one system prompt's pages (computed once, by the first request)
    and each request's own tokens after it; pages 0.. are the system's, then two or three per request."""
    config = NAMED_CONFIGS["tiny-llama"]
    weights = random_weights(config, dtype=dtype, device=device, seed=seed)
    model = LlamaModel(config, weights, device=torch.device("cpu"), dtype=dtype, ops=triton_ops)
    model._linear = torch.nn.functional.linear   # built for the CPU, whose float32 linears are oneDNN's
    model.rope.cos, model.rope.sin = model.rope.cos.to(device), model.rope.sin.to(device)
    g = torch.Generator().manual_seed(seed + 4)
    n_sys = system_pages * PAGE
    system = torch.randint(3, 250, (n_sys,), generator=g).tolist()
    prompts = [system + torch.randint(3, 250, (n,), generator=g).tolist() for n in suffixes]
    own = 2 if max(suffixes) + 1 <= 2 * PAGE else 3
    tables = [list(range(system_pages)) + [system_pages + own * i + j for j in range(own)] for i in range(len(prompts))]
    kv = KVCache.allocate(config, num_pages=system_pages + own * len(prompts) + 2, page_size=PAGE, dtype=dtype,
                          device=device)
    model.forward(build_forward_batch([(prompts[0], 0, tables[0], True)], PAGE, device), kv)
    model.forward(build_forward_batch([(p[n_sys:], n_sys, t, True) for p, t in zip(prompts[1:], tables[1:])],
                                      PAGE, device), kv)
    return model, kv, prompts, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cascade_forward_matches_plain_decode(dtype, device):
    device = torch.device(device)
    model, kv, prompts, tables = _prefilled_shared_prefix(dtype, device, seed=3, system_pages=3, suffixes=(2, 5, 3, 6))
    decode = [([p[-1] + 1], len(p), t, True) for p, t in zip(prompts, tables)]
    plan = plan_shared_prefixes([(t, len(p) + 1) for p, t in zip(prompts, tables)], PAGE, POLICY, KVB)
    assert plan is not None and plan.device.type == "cpu"    # the host plan; the runner moves it
    plan = plan.to(device)
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
    assert plan_shared_prefixes(rows, PAGE, strict, 524288) is None        # 47 MB of KV
    assert plan_shared_prefixes(rows, PAGE, strict, 2**30) is not None     # 90 GB of KV


def test_graph_path_needs_only_the_saved_reads():
    # In a cascade graph the extra kernels cost microseconds: no 40 GB rule, only the saved reads.
    shared = (1, 2, 3, 4)
    rows = [(shared + (10 + i,), 18) for i in range(5)]
    policy = CascadePolicy(min_saved_fraction=0.25, min_batch=2, min_shared_pages=2, min_plain_read_gb=40.0,
                           min_saved_read_gb_graph=1.0)
    # 4 of 5 rows' 16 shared tokens saved = 64 tokens: 64 MiB per token saves 4.3 GB, 8 MiB only 0.5 GB
    assert plan_shared_prefixes(rows, PAGE, policy, 2**26) is None                    # eager: < 40 GB read
    assert plan_shared_prefixes(rows, PAGE, policy, 2**26, graph=True) is not None
    assert plan_shared_prefixes(rows, PAGE, policy, 2**23, graph=True) is None        # saves < 1 GB


def test_graph_plan_buffers_pad_rows_and_groups():
    from kvshare_kernels.cascade_decode import plan_cascade

    bufs = CascadePlanBuffers([8, 16], PAGE, max_members=4, max_shared_len=64, prefix_splits={8: 2, 16: 1},
                              device=torch.device("cpu"))
    table = [[1, 2, 3, 9], [1, 2, 3, 10], [1, 2, 3, 11], [5, 6, 7, 12], [5, 6, 7, 13]]
    host = plan_cascade(torch.tensor(table, dtype=torch.int32), [15, 16, 14, 13, 16], PAGE, min_shared_pages=2,
                        max_members=4)
    assert host.num_groups == 2 and bufs.holds(host, 8) and bufs.covers(16) and not bufs.covers(4)
    for _ in range(3):          # alternating staging copies give the same result each time
        bufs.fill(host, 8)
        g = bufs.plan(8)
        assert (g.num_rows, g.num_groups, g.max_members, g.prefix_splits) == (8, max_groups(8), 4, 2)
        assert g.row_shared_len.tolist() == host.row_shared_len.tolist() + [0, 0, 0]
        assert g.group_shared_len.tolist() == host.group_shared_len.tolist() + [0, 0]
        assert g.group_rows[:2].tolist() == host.group_rows.tolist()
        assert (g.group_rows[2:] == -1).all()
    wide = plan_cascade(torch.tensor([[1, 2, 3]] * 10, dtype=torch.int32), [13] * 10, PAGE, max_members=4)
    assert wide.num_groups == 3 and not bufs.holds(wide, 8)     # 10 rows: not a batch-8 graph's plan
    with pytest.raises(ValueError):
        bufs.fill(wide, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_graph_resident_plan_matches_plain_decode(dtype, device):
    """What a cascade graph replays: persistent decode inputs and a plan padded with empty groups and
    padding rows, against the plain eager decode of the live rows."""
    device = torch.device(device)
    model, kv, prompts, tables = _prefilled_shared_prefix(dtype, device, seed=5, system_pages=4,
                                                          suffixes=(1, 6, 3, 7, 2))
    decode = [([p[-1] + 1], len(p), t, True) for p, t in zip(prompts, tables)]
    plain = model.forward(build_forward_batch(decode, PAGE, device, decode_max_context=32), kv)
    plan = plan_shared_prefixes([(t, len(p) + 1) for p, t in zip(prompts, tables)], PAGE, POLICY, KVB, graph=True)
    assert plan is not None and plan.num_groups == 1
    inputs = DecodeInputBuffers(max_batch=8, pages_per_seq=8, page_size=PAGE, device=device)
    plans = CascadePlanBuffers([8], PAGE, max_members=16, max_shared_len=32, prefix_splits={8: 2}, device=device)
    inputs.fill([(p[-1] + 1, len(p), t) for p, t in zip(prompts, tables)], 8)
    plans.fill(plan, 8)
    batch = inputs.forward_batch(8, max_context=32)
    cascaded = model.forward(type(batch)(**{**batch.__dict__, "cascade": plans.plan(8)}), kv)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cascaded[:5], plain, rtol=tol, atol=tol)
    assert cascaded[5:].isfinite().all()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_host_plan_pads_into_the_graph_plan_unchanged(data):
    """Property: for any batch of rows (random groups over shared pages) and any graph batch that holds
    it, the graph plan's live part equals the host plan and its padding is inert (shared length 0, no
    members), whatever an earlier, larger plan left in the staging copies."""
    from kvshare_kernels.cascade_decode import plan_cascade

    sizes = [4, 8, 16, 32]
    bufs = CascadePlanBuffers(sizes, PAGE, max_members=4, max_shared_len=256, prefix_splits=dict.fromkeys(sizes, 1),
                              device=torch.device("cpu"))
    for _ in range(2):
        n = data.draw(st.integers(1, 32))
        heads = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))     # which system prompt
        lens = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
        table = torch.tensor([[100 * h + j for j in range(4)] + [1000 + 10 * i + j for j in range(8)]
                              for i, h in enumerate(heads)], dtype=torch.int32)
        host = plan_cascade(table, lens, PAGE, max_members=4)
        batch = next(b for b in sizes if b >= n)
        assert bufs.holds(host, batch)
        bufs.fill(host, batch)
        g = bufs.plan(batch)
        gmax = max_groups(batch)
        assert g.row_shared_len[:n].tolist() == host.row_shared_len.tolist()
        assert not g.row_shared_len[n:].any()
        assert g.group_shared_len[:host.num_groups].tolist() == host.group_shared_len.tolist()
        assert not g.group_shared_len[host.num_groups:gmax].any()
        assert g.group_rows[:host.num_groups].tolist() == host.group_rows.tolist()
        assert (g.group_rows[host.num_groups:] == -1).all()
        bufs.check_integrity()


def test_planner_skips_the_plan_when_even_the_shareable_rows_cannot_pay(monkeypatch):
    # Two of six rows share a first page: at most their tokens can be saved, below 25% of the batch.
    import kvshare_kernels.cascade_decode as cd

    def must_not_plan(*a, **k):
        raise AssertionError("plan_cascade ran although no plan could pass the thresholds")

    rows = [((1, 2, 3), 6), ((1, 2, 4), 6)] + [((10 + i, 20 + i, 30 + i), 12) for i in range(4)]   # 12 of 60
    monkeypatch.setattr(cd, "plan_cascade", must_not_plan)
    assert plan_shared_prefixes(rows, PAGE, POLICY, KVB, graph=True) is None
    monkeypatch.undo()
    assert plan_shared_prefixes(rows, PAGE, POLICY, KVB, graph=True) is None     # same answer with the plan
