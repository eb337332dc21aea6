"""cascade_decode_attention (prefix once per group + suffix per row + exact merge) and plan_cascade.

Kernel tests run the Triton kernels (the interpreter on the CPU) on pools whose rows share prefix
pages the way the prefix cache makes them share: a trie of prefixes (a one-page chat template that
everyone shares, system prompts below it, longer sub-prefixes below those), rows ending anywhere
(inside the first page, exactly at a page boundary, one token past one), ungrouped rows, groups
larger than a program's member cap. Every page the kernels must not read is NaN, so a wrong read
shows. Ground truth: float64 attention on each row's dense K/V. The planner gets a Hypothesis test.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare_kernels import cascade_decode as cd
from kvshare_kernels import decode_attention, reference
from kvshare_kernels.checks import PageTableError
from paged_cases import TOL, dense_attention, rel_err


# ----------------------------------------------------------------------------------------------
# Pools with a trie of shared prefixes
# ----------------------------------------------------------------------------------------------

@dataclass
class TreeCase:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor       # int32 [B, P]
    context_lens: torch.Tensor     # int32 [B]
    dense_k: list[torch.Tensor]    # per row [len, Hkv, D] float64 (what the pool holds)
    dense_v: list[torch.Tensor]


def make_tree_case(prefixes: dict[str, tuple[str | None, int]], rows: list[tuple[str | None, int]], page_size: int,
                   hkv: int, d: int, dtype: torch.dtype, device: str, seed: int = 0) -> TreeCase:
    """prefixes: name -> (parent or None, pages); rows: (prefix name or None, context_len).

    A row shares the physical pages of its prefix chain that its context fills completely; a page
    its context ends inside is a private copy (copy on write), and the rest of its tokens are its
    own. Unused pool pages and a "trap" page (garbage entries past each context) hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    chain_pages: dict[str, int] = {}
    for name, (parent, n) in prefixes.items():
        chain_pages[name] = (chain_pages[parent] if parent else 0) + n
    prefix_pages = sum(n for _, n in prefixes.values())
    row_pages = [-(-ctx // page_size) for _, ctx in rows]
    num_pages = prefix_pages + sum(row_pages) + 4
    free = torch.randperm(num_pages, generator=gen).tolist()
    trap = free.pop()
    k_cache = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    # each prefix: its own pages' ids and tokens; a chain is the concatenation from the root
    chain: dict[str, tuple[list[int], torch.Tensor, torch.Tensor]] = {}
    for name, (parent, n) in prefixes.items():
        ids, k, v = chain[parent] if parent else ([], torch.empty(0, hkv, d, dtype=torch.float64),
                                                 torch.empty(0, hkv, d, dtype=torch.float64))
        new_ids = [free.pop() for _ in range(n)]
        nk = torch.randn(n * page_size, hkv, d, generator=gen, dtype=torch.float64)
        nv = torch.randn(n * page_size, hkv, d, generator=gen, dtype=torch.float64)
        for j, p in enumerate(new_ids):
            k_cache[p] = nk[j * page_size:(j + 1) * page_size].to(dtype)
            v_cache[p] = nv[j * page_size:(j + 1) * page_size].to(dtype)
        chain[name] = (ids + new_ids, torch.cat([k, nk]), torch.cat([v, nv]))
    max_pages = max(row_pages + [1]) + 2
    page_table = torch.full((len(rows), max_pages), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for i, (name, ctx) in enumerate(rows):
        k = torch.randn(ctx, hkv, d, generator=gen, dtype=torch.float64)
        v = torch.randn(ctx, hkv, d, generator=gen, dtype=torch.float64)
        shared = 0
        if name:
            ids, ck, cv = chain[name]
            n = min(ctx, len(ck))
            k[:n], v[:n] = ck[:n], cv[:n]
            shared = min(len(ids), ctx // page_size)
            page_table[i, :shared] = torch.tensor(ids[:shared], dtype=torch.int32)
        for j in range(shared, row_pages[i]):
            p = free.pop()
            page_table[i, j] = p
            tok = slice(j * page_size, min(ctx, (j + 1) * page_size))
            k_cache[p, : tok.stop - tok.start] = k[tok].to(dtype)
            v_cache[p, : tok.stop - tok.start] = v[tok].to(dtype)
        page_table[i, row_pages[i]::2] = trap
        dense_k.append(k.to(dtype).double())
        dense_v.append(v.to(dtype).double())
    return TreeCase(k_cache.to(device), v_cache.to(device), page_table.to(device),
                    torch.tensor([c for _, c in rows], dtype=torch.int32, device=device),
                    [x.to(device) for x in dense_k], [x.to(device) for x in dense_v])


def mixed_scenario(ps: int) -> tuple[dict, list]:
    """A chat-template page shared by all, two system prompts (one with a longer sub-prefix),
    rows ending in every interesting place, and rows that share nothing."""
    prefixes = {"T": (None, 1), "A": ("T", 3), "A2": ("A", 2), "C": (None, 2)}
    rows = [
        ("A", 4 * ps + 3),      # shares T+A (4 pages)
        ("A", 4 * ps + 1),      # last token one past the shared pages: shared prefix ends on a page boundary
        ("A", 4 * ps),          # context exactly 4 pages: the 4th page (its last token) stays in the suffix
        ("A2", 6 * ps + 5),     # the deeper sub-prefix
        ("A2", 7 * ps),
        ("A2", 6 * ps + 1),
        ("T", 3 * ps + 2),      # only the template page in common with the others
        (None, 2),              # context inside the first page
        ("C", 2 * ps + 1),
        ("C", 5 * ps),
        ("C", 3),               # shares the system prompt's tokens but not one full page
        (None, 1),
        (None, 3 * ps + 3),
    ]
    return prefixes, rows


def _run(case: TreeCase, hq: int, d: int, dtype: torch.dtype, device: str, plan_kw=None, **kw):
    page_size = case.k_cache.shape[1]
    plan = cd.plan_cascade(case.page_table.cpu(), case.context_lens.cpu(), page_size, **(plan_kw or {}))
    torch.manual_seed(1)
    b = case.page_table.shape[0]
    q = torch.randn(b, hq, d, dtype=torch.float64).to(dtype).to(device)
    scale = d ** -0.5
    out = torch.full((b, hq, d), float("nan"), dtype=dtype, device=device)     # every row must be written
    res = cd.cascade_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens,
                                      plan.to(device), scale, out, **kw)
    assert res is out
    for i, n in enumerate(case.context_lens.tolist()):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i])), f"row {i}: context 0 must give zeros"
            continue
        ref = dense_attention(q[i: i + 1], case.dense_k[i], case.dense_v[i], scale)[0]
        err = rel_err(out[i], ref)
        assert err < TOL[dtype], f"row {i} (len {n}, shared {int(plan.row_shared_len[i])}): rel err {err:.2e} {kw}"
    return plan, q, out


# ----------------------------------------------------------------------------------------------
# Kernel exactness
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (6, 2)], ids=["mha", "gqa2", "gqa3"])
def test_cascade_mixed_fp32(page_size, hq, hkv, device):
    prefixes, rows = mixed_scenario(page_size)
    case = make_tree_case(prefixes, rows, page_size, hkv, 16, torch.float32, device, seed=page_size + hq)
    plan, _, _ = _run(case, hq, 16, torch.float32, device, block_n=16)
    # the scenario must really exercise both paths: groups A (+A2 split off or not), C, and loners
    shared = plan.row_shared_len.tolist()
    assert plan.num_groups >= 2 and shared[7] == shared[11] == 0 and shared[10] == 0
    assert shared[1] == 4 * page_size and shared[2] <= 3 * page_size


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)], ids=["mha", "gqa2"])
def test_cascade_v_pool_with_its_own_strides(hq, hkv, device):
    """Both sides read V through its own offsets when its strides differ from K's (a V pool stored
    in wider rows), instead of K's (checks.row_offset_flags): the same answers."""
    prefixes, rows = mixed_scenario(4)
    case = make_tree_case(prefixes, rows, 4, hkv, 16, torch.float32, device, seed=40 + hq)
    wide = torch.full((*case.v_cache.shape[:3], 24), float("nan"), dtype=case.v_cache.dtype, device=device)
    wide[..., :16] = case.v_cache
    case.v_cache = wide[..., :16]
    assert case.v_cache.stride()[:3] != case.k_cache.stride()[:3]
    plan, _, _ = _run(case, hq, 16, torch.float32, device, block_n=16)
    assert plan.num_groups >= 2


@pytest.mark.parametrize("variant", [
    dict(prefix_splits=3, num_splits=2),                   # split both sides, some prefix splits empty
    dict(prefix_splits=1, num_splits=1, block_n=32),
    dict(heads_per_program=2, suffix_heads_per_program=1),  # MHA prefix with two KV heads (block-diagonal query)
    dict(suffix_block_n=16, prefix_splits=2),
])
def test_cascade_variants(variant, device):
    prefixes, rows = mixed_scenario(4)
    case = make_tree_case(prefixes, rows, 4, 2, 16, torch.float32, device, seed=3)
    _run(case, 2, 16, torch.float32, device, **variant)


@pytest.mark.parametrize("max_members", [16, 4, 3])
def test_cascade_large_group(max_members, device):
    # 20 rows over one 3-page prompt: cut into groups of at most max_members (20 -> 10+10, 5x4, 7+7+6)
    ps = 4
    rows = [("S", 3 * ps + 1 + (i * 5) % (2 * ps)) for i in range(20)] + [(None, 9)]
    case = make_tree_case({"S": (None, 3)}, rows, ps, 2, 16, torch.float32, device, seed=max_members)
    plan, _, _ = _run(case, 4, 16, torch.float32, device, plan_kw=dict(max_members=max_members), block_n=16)
    sizes = sorted(int((r >= 0).sum()) for r in plan.group_rows)
    assert sum(sizes) == 20 and max(sizes) - min(sizes) <= 1 and max(sizes) <= max_members


@pytest.mark.parametrize("dtype,hq,hkv,ps", [(torch.float16, 4, 2, 4), (torch.float16, 2, 2, 16),
                                             (torch.bfloat16, 4, 1, 16)])
def test_cascade_half(dtype, hq, hkv, ps, device):
    prefixes, rows = mixed_scenario(ps)
    case = make_tree_case(prefixes, rows, ps, hkv, 16, dtype, device, seed=5)
    _run(case, hq, 16, dtype, device, block_n=16)


def test_cascade_odd_head_dim_and_padding_rows(device):
    # head_dim 24 (masked to 32), a CUDA-graph padding row (context 0) inside a grouped batch
    ps = 4
    rows = [("S", 2 * ps + 3), (None, 0), ("S", 3 * ps), ("S", 2 * ps + 1), (None, 0)]
    case = make_tree_case({"S": (None, 3)}, rows, ps, 1, 24, torch.float32, device, seed=8)
    plan, _, _ = _run(case, 3, 24, torch.float32, device)
    assert plan.num_groups == 1 and plan.row_shared_len.tolist() == [8, 0, 8, 8, 0]


def test_cascade_without_groups_is_plain_decode(device):
    prefixes, rows = mixed_scenario(4)
    rows = [(None, n) for _, n in rows]
    case = make_tree_case(prefixes, rows, 4, 2, 16, torch.float32, device, seed=9)
    plan, q, out = _run(case, 4, 16, torch.float32, device)
    assert plan.num_groups == 0
    plain = decode_attention.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table,
                                                    case.context_lens, 16 ** -0.5)
    assert torch.equal(out, plain)


def test_cascade_lengths_grew_since_plan(device):
    # the plan stays valid while rows only append tokens: plan at step t, run at t + 5
    ps = 4
    rows = [("S", 2 * ps + 1), ("S", 2 * ps + 2), ("S", 3 * ps + 3)]
    grown = [(s, n + 5) for s, n in rows]
    case = make_tree_case({"S": (None, 3)}, grown, ps, 2, 16, torch.float32, device, seed=10)
    plan = cd.plan_cascade(case.page_table.cpu(), torch.tensor([n for _, n in rows]), ps)
    q = torch.randn(3, 4, 16, device=device)
    out = cd.cascade_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens,
                                      plan.to(device), 0.25, debug=True)
    for i in range(3):
        assert rel_err(out[i], dense_attention(q[i: i + 1], case.dense_k[i], case.dense_v[i], 0.25)[0]) < TOL[torch.float32]


def test_cascade_padded_plan(device):
    # a plan padded with empty groups (for a CUDA graph of fixed shape) gives the same result
    prefixes, rows = mixed_scenario(4)
    case = make_tree_case(prefixes, rows, 4, 2, 16, torch.float32, device, seed=13)
    plan = cd.plan_cascade(case.page_table.cpu(), case.context_lens.cpu(), 4)
    padded = plan.padded(plan.num_groups + 3)
    assert padded.group_rows[: plan.num_groups].tolist() == plan.group_rows.tolist()
    assert padded.row_shared_len.tolist() == plan.row_shared_len.tolist()
    assert (padded.group_rows[plan.num_groups:] == -1).all() and (padded.group_shared_len[plan.num_groups:] == 0).all()
    q = torch.randn(len(rows), 4, 16, device=device)
    args = (q, case.k_cache, case.v_cache, case.page_table, case.context_lens)
    a = cd.cascade_decode_attention(*args, plan.to(device), 0.3, prefix_splits=2)
    b = cd.cascade_decode_attention(*args, padded.to(device), 0.3, prefix_splits=2, debug=True)
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        plan.padded(plan.num_groups - 1)


def test_cascade_strided_q_and_reference(device):
    prefixes, rows = mixed_scenario(4)
    case = make_tree_case(prefixes, rows, 4, 2, 16, torch.float32, device, seed=11)
    plan = cd.plan_cascade(case.page_table.cpu(), case.context_lens.cpu(), 4).to(device)
    qkv = torch.randn(len(rows), 8, 16, device=device)
    q = qkv[:, :4]                               # a view of a fused projection
    out = cd.cascade_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, plan, 0.3)
    plain = reference.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 0.3)
    casc_ref = cd.cascade_decode_reference(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, plan, 0.3)
    assert rel_err(out, plain) < TOL[torch.float32]
    assert rel_err(casc_ref, plain) < 1e-6


def test_cascade_rejects_a_plan_that_does_not_fit(device):
    prefixes, rows = mixed_scenario(4)
    case = make_tree_case(prefixes, rows, 4, 2, 16, torch.float32, device, seed=12)
    plan = cd.plan_cascade(case.page_table.cpu(), case.context_lens.cpu(), 4)
    q = torch.randn(len(rows), 4, 16, device=device)
    args = (q, case.k_cache, case.v_cache)
    with pytest.raises(ValueError, match="rows of page size"):
        cd.cascade_decode_attention(q[:-1], case.k_cache, case.v_cache, case.page_table[:-1], case.context_lens[:-1],
                                    plan.to(device), 0.25)
    if device != "cpu":
        with pytest.raises(ValueError, match="plan.to"):
            cd.cascade_decode_attention(*args, case.page_table, case.context_lens, plan, 0.25)
    # a page table that changed under the plan (a member's shared page replaced): debug mode says so
    member = int(plan.group_rows[0, 1])
    pt = case.page_table.clone()
    pt[member, 0] = int(case.page_table[7, 0])
    with pytest.raises(PageTableError, match="differ at page_table column 0"):
        cd.cascade_decode_attention(*args, pt, case.context_lens, plan.to(device), 0.25, debug=True)
    shorter = case.context_lens.clone()
    shorter[member] = 1
    with pytest.raises(PageTableError, match="last token must stay"):
        cd.cascade_decode_attention(*args, case.page_table, shorter, plan.to(device), 0.25, debug=True)


# ----------------------------------------------------------------------------------------------
# The planner
# ----------------------------------------------------------------------------------------------

def _groups(plan: cd.CascadePlan) -> list[tuple[list[int], int]]:
    return [([m for m in r if m >= 0], n) for r, n in zip(plan.group_rows.tolist(), plan.group_shared_len.tolist())]


def test_plan_template_page_does_not_merge_system_prompts():
    # every row starts with the same template page; two 8-page system prompts of 16 rows each
    ps, rng = 16, np.random.default_rng(0)
    pt = np.zeros((34, 12), dtype=np.int32)
    pt[:, 0] = 7
    pt[:16, 1:9] = 100 + np.arange(8)
    pt[16:32, 1:9] = 200 + np.arange(8)
    pt[32:, 1:9] = rng.permutation(1000)[:16].reshape(2, 8) + 1000        # two one-off prompts
    pt[:, 9:] = (rng.permutation(10_000)[: 34 * 3] + 5000).reshape(34, 3)
    ctx = np.full(34, 10 * ps + 3)
    plan = cd.plan_cascade(pt, ctx, ps)
    groups = sorted(_groups(plan))
    assert groups == [(list(range(16)), 9 * ps), (list(range(16, 32)), 9 * ps), ([32, 33], ps)]


def test_plan_edges():
    ps = 4
    pt = np.array([[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 4, 7], [5, 6, 0, 0], [5, 6, 0, 0]], dtype=np.int32)
    # rows 0/1 could share 3 pages, but row 1's context ends on page 2 (its last token is page 2's first);
    # rows 3/4: identical garbage past contexts inside their first page must not count
    ctx = np.array([15, 9, 12, 3, 4])
    plan = cd.plan_cascade(pt, ctx, ps)
    assert _groups(plan) == [([0, 1, 2], 8)]
    assert plan.row_shared_len.tolist() == [8, 8, 8, 0, 0]
    assert cd.plan_cascade(pt, ctx, ps, min_shared_pages=3).num_groups == 0
    assert cd.plan_cascade(pt, ctx, ps, min_group=4).num_groups == 0
    empty = cd.plan_cascade(np.zeros((0, 4), np.int32), np.zeros(0, np.int32), ps)
    assert empty.num_groups == 0 and empty.buffer.numel() == 0
    assert cd.plan_cascade(torch.tensor(pt), torch.tensor(ctx), ps).buffer.tolist() == plan.buffer.tolist()
    moved = plan.to("cpu")
    assert moved.group_rows.tolist() == plan.group_rows.tolist() and moved.max_shared_len == 8


@st.composite
def batches(draw):
    """Page tables built from a few prefixes (a small trie) plus private pages, with garbage past
    each context that may coincide between rows."""
    page_size = draw(st.sampled_from([1, 4, 16]))
    prefixes: list[list[int]] = []
    next_id = 0
    for k in range(draw(st.integers(0, 5))):
        parent = draw(st.sampled_from([None] + list(range(k))))
        n = draw(st.integers(1, 4))
        prefixes.append((prefixes[parent] if parent is not None else []) + list(range(next_id, next_id + n)))
        next_id += n
    b = draw(st.integers(1, 40))
    width = 12
    pt = np.zeros((b, width), dtype=np.int64)
    ctx = np.zeros(b, dtype=np.int64)
    for i in range(b):
        pfx = prefixes[draw(st.integers(0, len(prefixes) - 1))] if prefixes and draw(st.booleans()) else []
        used = draw(st.integers(0, width))
        n_ctx = draw(st.integers(max(0, (used - 1) * page_size + 1) if used else 0, used * page_size))
        keep = min(len(pfx), used, draw(st.integers(0, len(pfx))) if draw(st.booleans()) else len(pfx))
        row = pfx[:keep] + list(range(next_id, next_id + used - keep))
        next_id += used - keep
        garbage = draw(st.sampled_from(["-1", "zero", "prefix"]))
        fill = {"-1": [-1] * width, "zero": [0] * width, "prefix": (prefixes[0] if prefixes else []) + [3] * width}[garbage]
        pt[i] = (row + fill[used:])[:width] if used < width else row[:width]
        ctx[i] = n_ctx
    params = dict(min_group=draw(st.sampled_from([1, 2, 3])), min_shared_pages=draw(st.integers(1, 2)),
                  max_members=draw(st.sampled_from([3, 4, 16])))
    return pt.astype(np.int32), ctx, page_size, params


def _naive_saving(pt, ctx, ps, min_group, min_shared_pages, max_members) -> int:
    """Pages saved by grouping all rows that start with the same page (the plain first-page grouping)."""
    cap = np.clip((ctx - 1) // ps, 0, pt.shape[1])
    total = 0
    for first in set(pt[cap >= min_shared_pages, 0].tolist()):
        rows = [i for i in range(len(ctx)) if cap[i] >= min_shared_pages and pt[i, 0] == first]
        v = min(min(int(cap[i]), _lcp(pt[rows[0]], pt[i])) for i in rows)
        if v >= min_shared_pages:
            total += sum(e - s - 1 for s, e, keep in cd._pieces(len(rows), min_group, max_members) if keep) * v
    return total


def _lcp(a, b) -> int:
    d = np.nonzero(a != b)[0]
    return int(d[0]) if len(d) else len(a)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_plan_properties(batch):
    pt, ctx, ps, params = batch
    plan = cd.plan_cascade(pt, ctx, ps, **params)
    cap = np.clip((ctx - 1) // ps, 0, pt.shape[1])
    seen: dict[int, int] = {}
    saving = 0
    for g, (members, n) in enumerate(_groups(plan)):
        # a group: distinct rows, within the size bounds, each in no other group
        assert max(2, params["min_group"]) <= len(members) <= params["max_members"]
        assert len(set(members)) == len(members)
        for m in members:
            assert m not in seen, f"row {m} in groups {seen[m]} and {g}"
            seen[m] = g
        # whole pages, at least min_shared_pages, each member's last token left out
        assert n % ps == 0 and n // ps >= params["min_shared_pages"]
        pages = n // ps
        assert all(n <= ctx[m] - 1 for m in members)
        # really common ...
        assert all((pt[m, :pages] == pt[members[0], :pages]).all() for m in members)
        # ... and maximal for this grouping: one more page is not common or not shareable by everyone
        longest = min(min(int(cap[m]), _lcp(pt[members[0]], pt[m])) for m in members)
        assert pages == longest
        saving += (len(members) - 1) * pages
    # row_shared_len agrees with the groups
    expect = [plan.group_shared_len.tolist()[seen[i]] if i in seen else 0 for i in range(len(ctx))]
    assert plan.row_shared_len.tolist() == expect
    # no two rows left out share a shareable page prefix that would have been worth a group
    if params["min_group"] <= 2:
        out = [i for i in range(len(ctx)) if i not in seen]
        for x in out:
            for y in out:
                if x < y:
                    assert min(int(cap[x]), int(cap[y]), _lcp(pt[x], pt[y])) < params["min_shared_pages"], (x, y)
    # at least as good as grouping by first page
    assert saving >= _naive_saving(pt, ctx, ps, **params)


def test_plan_cost_at_full_size():
    # B = P = 256: 16 groups of 16 behind a shared template page; keep the host planner cheap
    import time
    rng = np.random.default_rng(1)
    pt = (rng.permutation(256 * 256).reshape(256, 256) + 10_000).astype(np.int32)
    pt[:, 1:129] = np.repeat(rng.permutation(16 * 128).reshape(16, 128), 16, axis=0)
    pt[:, 0] = 7
    ctx = np.full(256, 4000)
    cd.plan_cascade(pt, ctx, 16)
    t = time.perf_counter()
    plan = cd.plan_cascade(pt, ctx, 16)
    took = time.perf_counter() - t
    assert plan.num_groups == 16 and set(plan.group_shared_len.tolist()) == {129 * 16}
    assert took < 0.05, f"plan_cascade took {took * 1e3:.1f} ms"


# ----------------------------------------------------------------------------------------------
# GPU: full shapes, compiled
# ----------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs CUDA (compiled Triton)")


def _gpu_batch(groups: int, members: int, prefix: int, hkv: int, dtype, loners: int = 3, page_size: int = 16,
               seed: int = 0):
    """Random pool: `groups` prompts of `prefix` tokens, `members` rows each with 1..300 own tokens, plus loners."""
    rnd = random.Random(seed)
    rows = []
    for g in range(groups):
        rows += [(f"g{g}", prefix + rnd.randint(1, 300)) for _ in range(members)]
    rows += [(None, rnd.randint(1, 3000)) for _ in range(loners)]
    rnd.shuffle(rows)
    b = len(rows)
    pages_per = [-(-n // page_size) for _, n in rows]
    max_pages = max(pages_per) + 1
    num_pages = groups * (prefix // page_size) + sum(pages_per) + 8
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(num_pages, page_size, hkv, 128, device="cuda", generator=gen).to(dtype)
    v = torch.randn(num_pages, page_size, hkv, 128, device="cuda", generator=gen).to(dtype)
    ids = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    shared = {f"g{g}": [ids.pop() for _ in range(prefix // page_size)] for g in range(groups)}
    pt = torch.zeros(b, max_pages, dtype=torch.int32)
    for i, (name, n) in enumerate(rows):
        own = shared[name][: n // page_size] if name else []
        pt[i, : pages_per[i]] = torch.tensor(own + [ids.pop() for _ in range(pages_per[i] - len(own))])
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    return k, v, pt, lens


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("hq,hkv", [(32, 8), (32, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups,members", [(4, 16), (3, 37)])
def test_gpu_cascade_full(hq, hkv, dtype, groups, members):
    k, v, pt, lens = _gpu_batch(groups, members, 2048, hkv, dtype, seed=hq + groups)
    plan = cd.plan_cascade(pt, lens, 16)
    assert plan.num_groups >= groups
    pt, lens = pt.cuda(), lens.cuda()
    q = torch.randn(pt.shape[0], hq, 128, device="cuda", dtype=dtype)
    ref = reference.paged_decode_attention(q, k, v, pt, lens, 128 ** -0.5)
    variants = [dict(), dict(prefix_splits=1, num_splits=1, overlap=False), dict(prefix_splits=8, num_splits=4)]
    if hq == hkv:
        variants.append(dict(heads_per_program=2, overlap=False))
    for kw in variants:
        out = torch.full_like(q, float("nan"))
        cd.cascade_decode_attention(q, k, v, pt, lens, plan.to("cuda"), 128 ** -0.5, out, **kw)
        assert rel_err(out, ref) < 1.5e-2, kw


@pytest.mark.gpu
@needs_cuda
def test_gpu_cascade_in_cuda_graph():
    # nothing read back: the launcher captures into a CUDA graph; lengths change between replays, and
    # so does the plan (copied into the captured plan's buffer, both padded to the same group count)
    k, v, pt, lens = _gpu_batch(2, 16, 1024, 8, torch.bfloat16, seed=3)
    plan = cd.plan_cascade(pt, lens, 16)
    # a smaller plan, valid for the same batch: 10 rows of one group left out (they read all their pages)
    hidden = pt.clone()
    hidden[plan.group_rows[0, :10].long(), 0] = 10**6 + torch.arange(10, dtype=torch.int32)
    other = cd.plan_cascade(hidden, lens, 16)
    assert (plan.num_groups, other.num_groups) == (2, 2) and (other.row_shared_len > 0).sum() == 22
    pt, lens = pt.cuda(), lens.cuda()
    q = torch.randn(pt.shape[0], 32, 128, device="cuda", dtype=torch.bfloat16)
    for overlap in (True, False):          # the side stream of the prefix kernel forks and joins inside the graph
        dplan = plan.padded(4).pin_memory().to("cuda", non_blocking=True)
        out = torch.empty_like(q)
        run = lambda: cd.cascade_decode_attention(q, k, v, pt, lens, dplan, 0.088, out, max_context=4096,  # noqa: E731
                                                  prefix_splits=2, overlap=overlap)
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for new_plan in (plan, other):
            dplan.buffer.copy_(new_plan.padded(4).buffer)
            q.copy_(torch.randn_like(q))
            lens.add_(-1).clamp_(min=1)
            lens.copy_(torch.maximum(lens, dplan.row_shared_len + 1))      # still a valid plan
            graph.replay()
            torch.cuda.synchronize()
            ref = reference.paged_decode_attention(q, k, v, pt, lens, 0.088)
            assert rel_err(out, ref) < 1.5e-2, (overlap, new_plan.num_groups)
