"""Cascade (shared-prefix) decode attention: a group's common prefix pages are read once for all its rows.

The prefix cache makes requests with a common prompt share the same physical pages, but
``paged_decode_attention`` still reads those pages once per request: a batch of 16 requests over
one 2k-token system prompt reads the prompt 16 times, and decode is bandwidth-bound. Here:

1. ``plan_cascade`` (host, numpy) groups batch rows whose page tables start with the same run of
   full pages and records each group's shared length. It runs before the step, from the page
   tables and lengths the engine already has on the host, so the kernels never read anything
   back (no synchronisation; capturable when the plan's shape is fixed).
2. A *prefix* kernel, grid (KV-head block, group, split), loads each K/V tile of the group's
   shared pages once and multiplies it against all the group's query rows times the query heads
   of that KV head (a Q tile of members x q_per_kv rows, ``tl.dot``). It writes a partial
   (normalised output, base-2 log-sum-exp) per (row, head, split).
3. The *suffix*: every row attends over its own tokens from ``shared_len`` to ``context_len``.
   This is the existing split-K decode kernel unchanged, run on a shifted page table (row b's
   columns start at its first private page; built on the device by a one-launch gather) and
   shortened lengths, with partial outputs on.
4. A merge kernel combines the suffix and prefix partials exactly (log-sum-exp weights).

8-bit pools: both kernels read them the same way (tiles converted to the query's dtype, int8's
per-token scales folded into the scores and probabilities, fp8's into the score scale and the
output), so the cascade result stays the decode kernel's.

The prefix kernel runs on a side stream, concurrently with the suffix (joined before the merge;
capturable in a CUDA graph).

Rows outside any group have shared length 0 and go entirely through the suffix path, so the
function is correct for any batch; a plan without groups calls ``paged_decode_attention`` itself.

See docs/develop/kernels.md for the plan layout, the heuristics and what is tested.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from . import checks, kv_quant, reference
from . import decode_attention as _da
from .checks import PageTableError, interpreter_bf16
from .kv_tiles import P_GAIN, dot_query, kv_rows, load_kv_tile, page_index, token_scales
from .kv_write import scale_launch_args

__all__ = ["CascadePlan", "plan_cascade", "cascade_decode_attention", "cascade_decode_reference",
           "check_plan_values", "graph_prefix_splits"]

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# The plan (host)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)   # a tensor field: no value equality
class CascadePlan:
    """Which batch rows read a common prefix together; built by :func:`plan_cascade`.

    All per-row and per-group numbers live in ONE int32 tensor, ``buffer`` (contiguous, so the
    plan goes to the GPU in one copy: ``plan.to("cuda", non_blocking=True)`` after
    ``plan.pin_memory()``), laid out as

        buffer[0 : B]                 row_shared_len    tokens of row b read by the prefix kernel
                                                        (a multiple of page_size; 0 = ungrouped)
        buffer[B : B + G]             group_shared_len  tokens every member of group g shares
        buffer[B + G : B + G + G*M]   group_rows        [G, M] member rows of group g, -1 padded

    The host ints size the launch grid and the prefix split-K without reading the buffer.
    A group has at most ``max_members`` rows; a larger set of rows sharing a prefix is cut into
    several groups (each reads the prefix once).
    """

    page_size: int
    num_rows: int           # B: rows of the page table the plan was built for
    num_groups: int         # G
    max_members: int        # M: width of group_rows (rows per prefix program)
    max_shared_len: int     # max of group_shared_len (0 without groups); an upper bound in a graph's plan
    buffer: torch.Tensor    # int32 [B + G + G*M]
    prefix_splits: int | None = None   # fixed prefix split-K (a CUDA graph's); None: chosen per call

    @property
    def row_shared_len(self) -> torch.Tensor:
        return self.buffer[: self.num_rows]

    @property
    def group_shared_len(self) -> torch.Tensor:
        return self.buffer[self.num_rows: self.num_rows + self.num_groups]

    @property
    def group_rows(self) -> torch.Tensor:
        start = self.num_rows + self.num_groups
        return self.buffer[start: start + self.num_groups * self.max_members].view(self.num_groups, self.max_members)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> CascadePlan:
        return dataclasses.replace(self, buffer=self.buffer.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> CascadePlan:
        return dataclasses.replace(self, buffer=self.buffer.pin_memory())

    def padded(self, num_groups: int) -> CascadePlan:
        """The same plan with empty groups (no rows, length 0) up to ``num_groups``: their prefix
        programs do nothing, so a CUDA graph captured for a fixed group count (and a fixed
        ``prefix_splits``) can replay any plan with at most that many groups."""
        if num_groups < self.num_groups:
            raise ValueError(f"CascadePlan.padded: {num_groups} < the plan's {self.num_groups} groups")
        b, g, m = self.num_rows, self.num_groups, self.max_members
        extra = num_groups - g
        buf = torch.cat([self.buffer[: b + g], self.buffer.new_zeros(extra), self.buffer[b + g:],
                         self.buffer.new_full((extra * m,), -1)])
        return dataclasses.replace(self, num_groups=num_groups, buffer=buf)

    def shared_tokens_read(self) -> int:
        """Prefix tokens the prefix kernel reads (per layer and KV head): one pass per group."""
        return int(self.group_shared_len.sum()) if self.num_groups else 0


def _host_array(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            # A device tensor would make the planner synchronise; the engine has these on the host.
            raise ValueError(f"plan_cascade: {name} must be on the CPU, got {x.device}")
        x = x.numpy()
    return np.asarray(x)


@functools.lru_cache(maxsize=4096)
def _pieces(n: int, min_group: int, max_members: int) -> tuple[tuple[int, int, bool], ...]:
    """Cut n rows into ceil(n / max_members) near-equal pieces [s, e) (17 -> 9 + 8, never 16 + 1);
    the flag says whether a piece is a group: one below max(2, min_group) rows is not (one row
    reading "its" prefix alone saves nothing)."""
    if n == 0:
        return ()
    k = -(-n // max_members)
    bounds = [(i * n) // k for i in range(k + 1)]
    return tuple((s, e, e - s >= max(2, min_group)) for s, e in zip(bounds[:-1], bounds[1:]))


class _Node:
    """An LCP interval of the sorted rows (a node of their page trie) during the bottom-up pass."""
    __slots__ = ("v", "lb", "leaves", "children", "best", "groups", "left")

    def __init__(self, v: int, lb: int):
        self.v, self.lb = v, lb
        self.leaves: list[int] = []
        self.children: list[_Node] = []

    def close(self, rb: int, min_group: int, max_members: int) -> None:
        """Best grouping inside this node: the whole node as one group at depth v, or the children's
        best choices plus the rows they leave ungrouped (which share at least v pages) as one group.
        Groups are kept as sorted position lists, or (lb, rb) for a whole node (expanded at the end)."""
        def saving(n: int) -> int:
            return sum(e - s - 1 for s, e, keep in _pieces(n, min_group, max_members) if keep) * self.v

        left = self.leaves + [r for c in self.children for r in c.left]
        s_kids = sum(c.best for c in self.children) + saving(len(left))
        s_all = saving(rb - self.lb + 1)
        if s_all > 0 and s_all >= s_kids:
            self.best, self.groups = s_all, [(self.lb, rb)]
            self.left = [self.lb + r for s, e, keep in _pieces(rb - self.lb + 1, min_group, max_members)
                         if not keep for r in range(s, e)]
        else:
            left.sort()
            self.best = s_kids
            self.groups = [g for c in self.children for g in c.groups]
            pieces = _pieces(len(left), min_group, max_members) if self.v else ((0, len(left), False),)
            if any(keep for _, _, keep in pieces):
                self.groups.append(left)
            self.left = [left[r] for s, e, keep in pieces if not keep for r in range(s, e)]
        self.children = []


def _select_groups(h: list[int], min_group: int, max_members: int) -> list[range | list[int]]:
    """Sets of sorted row positions to group (before cutting at max_members), maximising the page
    reads saved over the choices made at the nodes of the rows' page trie.

    h[i] (i = 1..n-1) is the number of full pages rows i-1 and i (in lexicographic order) share;
    h[0] is unused. A run's common prefix is the min of its h, and the runs with a given min that
    cannot grow are the nodes of the rows' page trie (LCP intervals). Bottom-up, each node keeps the
    better of "the whole node is one group" and "its children's choices, plus its still-ungrouped
    rows as one group" (``_Node.close``); a group of c rows over v pages saves (c - 1) * v reads.
    That keeps a chat-template page every request shares from fusing the long system-prompt groups
    into one shallow group, and it leaves no two ungrouped rows that share a page (for
    max_members >= 3 and min_group <= 2). One pass with a stack over the n - 1 values (the standard
    LCP-interval traversal), visiting only the first of each run of equal values (the others only
    add their row to the open node): O(runs) Python steps, O(B) nodes joining their children's lists.
    """
    n = len(h)
    root = _Node(0, 0)
    stack = [root]

    def step(i: int, hi: int) -> None:
        if hi <= stack[-1].v:
            stack[-1].leaves.append(i - 1)          # row i-1 is in no deeper interval
        lb, last = i - 1, None
        while hi < stack[-1].v:
            node = stack.pop()
            node.close(i - 1, min_group, max_members)
            lb, last = node.lb, node
            if hi <= stack[-1].v:
                stack[-1].children.append(node)
                last = None
        if hi > stack[-1].v:
            node = _Node(hi, lb)
            if last is not None:
                node.children.append(last)
            else:
                node.leaves.append(i - 1)
            stack.append(node)

    hv = np.asarray(h[1:])
    starts = [1] + (np.flatnonzero(hv[1:] != hv[:-1]) + 2).tolist() + [n]
    for i, j in zip(starts[:-1], starts[1:]):
        step(i, h[i])
        # i+1 .. j-1 repeat h[i] == the open node's value: their left rows i .. j-2 are its leaves
        stack[-1].leaves.extend(range(i, j - 1))
    step(n, 0)
    return [range(g[0], g[1] + 1) if isinstance(g, tuple) else g for c in root.children for g in c.groups]


def plan_cascade(page_tables: np.ndarray | torch.Tensor, context_lens: np.ndarray | torch.Tensor | Sequence[int],
                 page_size: int, *, min_group: int = 2, min_shared_pages: int = 1,
                 max_members: int = 16) -> CascadePlan:
    """Group the rows of a decode batch that share leading full pages; returns a CPU plan.

    page_tables int [B, P] and context_lens int [B], on the host (numpy or CPU tensors). Row b may
    share only full pages that hold none of its last token: at most (context_lens[b] - 1) // page_size
    pages, so the current token's own K/V always stays in the row's suffix. A row is in at most one
    group; groups have at least max(2, ``min_group``) rows and share at least ``min_shared_pages``
    pages; other rows get shared length 0. ``max_members`` caps the rows of one group (one prefix
    program holds members x q_per_kv query rows); larger sets are cut into near-equal groups.

    Each group's shared length is exactly its members' longest common full-page prefix (capped as
    above): maximal for the chosen grouping. The grouping maximises the page reads saved over the
    choices made at the nodes of the rows' page trie (``_select_groups``); it is not a global optimum.

    Cost: O(B * W) vectorised numpy for the masking and the neighbour comparisons (W = the longest
    shareable run, <= P), a byte-wise sort of the B masked rows (O(B log B) comparisons of up to W
    entries), and a Python stack pass over the B - 1 neighbour LCPs. About 0.2 ms at B = P = 256
    with 16 groups (perf/kernels/bench_cascade_decode.py times it).
    """
    if min_group < 1 or min_shared_pages < 1 or max_members < 1:
        raise ValueError("plan_cascade: min_group, min_shared_pages and max_members must be >= 1")
    pt = _host_array(page_tables, "page_tables")
    ctx = _host_array(context_lens, "context_lens").astype(np.int64).reshape(-1)
    if pt.ndim != 2 or pt.shape[0] != ctx.shape[0]:
        raise ValueError(f"plan_cascade: page_tables {pt.shape} and context_lens {ctx.shape} disagree")
    b, p = pt.shape
    cap = np.clip((ctx - 1) // page_size, 0, p)          # pages row b may share (ctx 0 -> 0)
    shared_pages: list[int] = []                         # per group
    # Only rows whose first page another row also starts with can share anything.
    cand = np.nonzero(cap >= min_shared_pages)[0]
    if len(cand) >= 2:
        _, inv, counts = np.unique(pt[cand, 0], return_inverse=True, return_counts=True)
        cand = cand[counts[inv] >= 2]
    if len(cand) >= max(2, min_group):
        n = len(cand)
        ccap = cap[cand]
        width = int(ccap.max())
        # Entries past a row's shareable pages (garbage, or pages the row may not share) become -1.
        key = pt[cand, :width].astype(np.int32)
        lo = int(ccap.min())
        if lo < width:      # only the columns past the smallest cap can need it
            np.putmask(key[:, lo:], np.arange(width - lo)[None, :] >= (ccap - lo)[:, None], -1)
        # Sorting rows byte-wise (fixed-width entries) is lexicographic over entries for some
        # total order of the entries, enough to make rows with a common prefix contiguous.
        rows = np.ascontiguousarray(key.astype(">i4")).view(np.dtype((np.void, 4 * width))).ravel()
        order = np.argsort(rows)
        srt = key[order]
        differ = srt[1:] != srt[:-1]                               # [n-1, W]
        first = differ.argmax(axis=1)
        lcp = np.where(differ[np.arange(n - 1), first], first, width)
        # The -1 fill makes rows equal past their caps; the cap of either row bounds what they share.
        scap = ccap[order]
        h = np.minimum(lcp, np.minimum(scap[1:], scap[:-1]))
        h[h < min_shared_pages] = 0
        h = [0] + h.tolist()
        gid = np.full(n, -1, dtype=np.int64)           # group of each sorted position
        for pos in _select_groups(h, min_group, max_members):
            for s, e, keep in _pieces(len(pos), min_group, max_members):
                if keep:
                    piece = pos[s:e]
                    gid[slice(piece.start, piece.stop) if isinstance(piece, range) else piece] = len(shared_pages)
                    # the exact common prefix of sorted rows p..q is min(h[p+1..q]); a piece of a
                    # larger group may share more than the group
                    shared_pages.append(min(h[piece[0] + 1: piece[-1] + 1]))
        grouped = np.flatnonzero(gid >= 0)
        member_rows, member_gid = cand[order][grouped], gid[grouped]
    g = len(shared_pages)
    buf = np.zeros(b + g + g * max_members, dtype=np.int32)
    row_shared = buf[:b]
    group_len = buf[b: b + g]
    group_rows = buf[b + g:].reshape(g, max_members)
    group_rows[:] = -1
    if g:
        o = np.lexsort((member_rows, member_gid))          # by group, rows ascending within
        member_rows, member_gid = member_rows[o], member_gid[o]
        sizes = np.bincount(member_gid, minlength=g)
        slot = np.arange(len(member_rows)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        group_rows[member_gid, slot] = member_rows
        group_len[:] = np.asarray(shared_pages) * page_size
        row_shared[member_rows] = group_len[member_gid]
    return CascadePlan(page_size=page_size, num_rows=b, num_groups=g, max_members=max_members,
                       max_shared_len=int(group_len.max()) if g else 0, buffer=torch.from_numpy(buf))


def check_plan_values(plan: CascadePlan, page_table: torch.Tensor, context_lens: torch.Tensor) -> None:
    """Debug check (reads everything back, so it synchronises): the plan fits this batch.

    Each group's members hold the same page ids over the shared length, that length is whole
    pages and leaves each member's last token out, and row_shared_len agrees with the groups.
    """
    pt = page_table.detach().cpu().long()
    lens = context_lens.detach().cpu().long()
    row_shared = plan.row_shared_len.cpu().long()
    expect = torch.zeros_like(row_shared)
    for g, (members, n) in enumerate(zip(plan.group_rows.cpu().tolist(), plan.group_shared_len.cpu().tolist())):
        members = [m for m in members if m >= 0]
        if n % plan.page_size:
            raise PageTableError(f"cascade plan: group {g} shares {n} tokens, not whole pages of {plan.page_size}")
        pages = n // plan.page_size
        for m in members:
            if not 0 <= m < pt.shape[0]:
                raise PageTableError(f"cascade plan: group {g} names row {m}, the batch has {pt.shape[0]}")
            if n > 0 and n > lens[m] - 1:
                raise PageTableError(f"cascade plan: group {g} shares {n} tokens but row {m} has context_len "
                                     f"{int(lens[m])} (the last token must stay in the row's suffix)")
            diff = (pt[m, :pages] != pt[members[0], :pages]).nonzero()
            if len(diff):
                j = int(diff[0, 0])
                raise PageTableError(f"cascade plan: group {g} rows {members[0]} and {m} differ at page_table "
                                     f"column {j} ({int(pt[members[0], j])} vs {int(pt[m, j])})")
            expect[m] = n
    bad = (expect != row_shared).nonzero()
    if len(bad):
        b = int(bad[0, 0])
        raise PageTableError(f"cascade plan: row_shared_len[{b}] = {int(row_shared[b])}, its group says {int(expect[b])}")


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _cascade_prefix_kernel(
    Q, K, V, KS, VS, PO, PLSE, PT, GROUP_ROWS, GROUP_LEN, scale_log2, v_scale, num_splits, num_q_heads,
    stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_sp, stride_st,
    stride_ptb,
    MEMBERS: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_QUANT: tl.constexpr, SAME_ROWS: tl.constexpr,
    ROWS32: tl.constexpr,
):
    # Program (KV-head block, group, split). Rows r of the Q tile: member r // (HEADS * GROUP) of the
    # group, query head hblk * HEADS * GROUP + r % (HEADS * GROUP). Columns as in the decode kernel:
    # HEADS KV heads side by side, block-diagonal query when HEADS > 1.
    hblk = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    shared = tl.load(GROUP_LEN + g)
    split_len = tl.cdiv(tl.cdiv(shared, num_splits), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, shared)

    r = tl.arange(0, BLOCK_R)
    member = r // (HEADS * GROUP)
    lh = r % (HEADS * GROUP)
    row_b = tl.load(GROUP_ROWS + g * MEMBERS + member, mask=member < MEMBERS, other=-1)
    r_valid = row_b >= 0
    row_b = tl.maximum(row_b, 0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c_head = c // BLOCK_D
    c_d = c % BLOCK_D
    c_mask = c_d < HEAD_DIM
    head = hblk * (HEADS * GROUP) + lh
    q_mask = r_valid[:, None] & c_mask[None, :] & ((lh // GROUP)[:, None] == c_head[None, :])
    q = tl.load(Q + row_b[:, None] * stride_qb + head[:, None] * stride_qh + c_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q = dot_query(q, KV_QUANT)

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    # Every member holds the same page ids over the shared pages: read them from the first member.
    leader = tl.maximum(tl.load(GROUP_ROWS + g * MEMBERS), 0).to(tl.int64)
    pt_row = PT + leader * stride_ptb
    kvh0 = hblk * HEADS
    k_cols = (kvh0 + c_head) * stride_kh + c_d
    v_cols = (kvh0 + c_head) * stride_vh + c_d
    row_head = lh // GROUP
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if PAGE_SIZE % BLOCK_N == 0:
            page = page_index(tl.load(pt_row + n // PAGE_SIZE), ROWS32)
        else:
            page = page_index(tl.load(pt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0), ROWS32)
        in_page = offs_n % PAGE_SIZE
        if BLOCK_D == HEAD_DIM:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & c_mask[None, :]
        s_rows = page * stride_sp + in_page * stride_st      # int8's scales of these tokens
        k_rows, v_rows = kv_rows(page, in_page, stride_kp, stride_kt, stride_vp, stride_vt, SAME_ROWS)
        k = load_kv_tile(K, k_rows, k_cols, kv_mask, KV_QUANT)
        v = load_kv_tile(V, v_rows, k_cols if SAME_ROWS else v_cols, kv_mask, KV_QUANT)
        if UPCAST or KV_QUANT != 0:     # the interpreter's tl.dot multiplies bf16 as raw integers
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if KV_QUANT == 2:       # int8 scales fold into the score columns and p (decode_attention)
            qk = qk * token_scales(KS, s_rows, kvh0, row_head, n_mask, scale_log2, HEADS, BLOCK_R, BLOCK_N)
        else:
            qk = qk * scale_log2
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_QUANT == 2:
            p_v = p * token_scales(VS, s_rows, kvh0, row_head, n_mask, P_GAIN, HEADS, BLOCK_R, BLOCK_N)
        else:
            p_v = p
        acc = acc * alpha[:, None] + tl.dot(p_v.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if HEADS == 1:
        o = acc
    else:
        acc3 = tl.reshape(acc, [BLOCK_R, HEADS, BLOCK_D])
        own = (lh // GROUP)[:, None, None] == tl.arange(0, HEADS)[None, :, None]
        o = tl.sum(tl.where(own, acc3, 0.0), axis=1)
    empty = l_i == 0.0
    if KV_QUANT == 2:
        v_scale = v_scale / P_GAIN
    o = o * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    d = tl.arange(0, BLOCK_D)
    # Partials by batch row: PO [B, Hq, S, D], PLSE [B, Hq, S] (fp32, log2 domain).
    row = (row_b * num_q_heads + head) * num_splits + s
    tl.store(PO + row[:, None] * HEAD_DIM + d[None, :], o, mask=r_valid[:, None] & (d < HEAD_DIM)[None, :])
    tl.store(PLSE + row, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))), mask=r_valid)


@triton.jit
def _suffix_table_kernel(PT, CTX, SHARED, SPT, SCTX, stride_ptb, num_cols,
                         PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr):
    """Row b of the suffix table = row b of the page table from its first private page on."""
    b = tl.program_id(0)
    shared = tl.load(SHARED + b)
    n = tl.maximum(tl.load(CTX + b) - shared, 0)
    tl.store(SCTX + b, n)
    skip = shared // PAGE_SIZE
    # only the columns the suffix reads; the decode kernel never looks past its context
    for j0 in range(0, tl.cdiv(n, PAGE_SIZE), BLOCK_P):
        j = j0 + tl.arange(0, BLOCK_P)
        m = (j + skip) < num_cols
        pages = tl.load(PT + b * stride_ptb + skip + j, mask=m, other=0)
        tl.store(SPT + b * num_cols + j, pages, mask=m)


@triton.jit
def _merge_in(PO, PLSE, bh, s, num_splits, h_mask, d, d_mask, m_i, l_i, acc, HEAD_DIM: tl.constexpr):
    """Fold split s of the partials (o normalised, lse base 2) into the running (m, l, acc)."""
    row = bh * num_splits + s
    lse = tl.load(PLSE + row, mask=h_mask, other=float("-inf"))
    o = tl.load(PO + row[:, None] * HEAD_DIM + d[None, :], mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    m_new = tl.maximum(m_i, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # nothing seen yet: weights 0, not NaN
    alpha = tl.exp2(m_i - m_safe)
    w = tl.exp2(lse - m_safe)
    return m_new, l_i * alpha + w, acc * alpha[:, None] + w[:, None] * o


@triton.jit
def _cascade_merge_kernel(SPO, SPLSE, PPO, PPLSE, SHARED, O, num_q_heads, suffix_splits, prefix_splits,
                          stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    """out = sum_i 2^lse_i o_i / sum_i 2^lse_i over the suffix splits and, for a grouped row, the prefix
    splits (running max, so exact in fp32). Program (row, block of query heads). The prefix partials of
    an ungrouped row were never written: not read."""
    b = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < num_q_heads
    bh = (b * num_q_heads + h).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s in range(0, suffix_splits):
        m_i, l_i, acc = _merge_in(SPO, SPLSE, bh, s, suffix_splits, h_mask, d, d_mask, m_i, l_i, acc, HEAD_DIM)
    for s in range(0, tl.where(tl.load(SHARED + b) > 0, prefix_splits, 0)):
        m_i, l_i, acc = _merge_in(PPO, PPLSE, bh, s, prefix_splits, h_mask, d, d_mask, m_i, l_i, acc, HEAD_DIM)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]          # context_len 0: zeros
    tl.store(O + b * stride_ob + h[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=h_mask[:, None] & d_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

# Defaults from a sweep on the H200 (16 request per group, prompt 2048, suffix 128..384, fp16, page
# 16; docs/develop/kernels.md has the numbers). One KV head per program and 64-token tiles for both
# head layouts: the decode kernel's MHA pairing of two KV heads (block-diagonal query) doubles the
# prefix kernel's dot work and measured 20% slower there (178 vs 144 us, 16 groups); 32- or 128-
# token tiles and 8 warps were no better. Tiles of 128+ rows (e.g. 16 members x 8 query heads) get
# 8 warps: the fp32 accumulator alone is 128 registers per thread at 4 warps.
PREFIX_BLOCK_N = 64
PREFIX_NUM_WARPS = 4
PREFIX_NUM_STAGES = 3
# Prefix split-K target: about this many Q-tile rows in flight per SM, i.e. ~4 programs per SM for
# MHA (16-row tiles) and ~1 for GQA 4 (64 rows, compute-heavy). Measured best with the overlap:
# 4 groups -> 4 splits, 16 groups -> 1 split, for both head layouts.
PREFIX_ROWS_PER_SM = 64
# Each prefix split writes rows x D fp32 partials that the merge reads back; a split must read at
# least this many times those bytes of K/V, or split-K costs more than it hides.
PREFIX_MIN_READ_OVER_PARTIAL = 4
MERGE_HEADS_PER_PROGRAM = 8
# Prefix kernel on a side stream, concurrent with the suffix kernel: 3-17% faster in every
# measured case (most for GQA, whose prefix kernel is compute-heavy and the suffix memory-bound).
OVERLAP = True


@functools.lru_cache(maxsize=16)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def prefix_config(num_q_heads: int, num_kv_heads: int, max_members: int) -> dict:
    rows = triton.next_power_of_2(max(16, max_members * (num_q_heads // num_kv_heads)))
    return dict(block_n=PREFIX_BLOCK_N, num_warps=8 if rows >= 128 else PREFIX_NUM_WARPS,
                num_stages=PREFIX_NUM_STAGES, heads_per_program=1)


def choose_prefix_splits(num_groups: int, programs_per_group: int, max_shared_len: int, rows: int, heads: int,
                         elem_size: int, device: torch.device, block_n: int) -> int:
    """Split-K of the prefix from host-known numbers only (the plan's lengths, the shapes)."""
    want = PREFIX_ROWS_PER_SM * _da._num_sms(device) // max(1, num_groups * programs_per_group * rows)
    # partial bytes per split: rows * D * 4 written + read; K/V bytes per token: heads * 2 * D * elem
    min_tokens = PREFIX_MIN_READ_OVER_PARTIAL * (2 * rows * 4) / (heads * 2 * elem_size)
    min_tokens = max(block_n, triton.cdiv(int(min_tokens), block_n) * block_n)
    by_len = triton.cdiv(max(1, max_shared_len), min_tokens)
    return max(1, min(want, by_len, _da.MAX_SPLITS))


def graph_prefix_splits(batch: int, num_q_heads: int, num_kv_heads: int, max_members: int, max_shared_len: int,
                        elem_size: int, device: torch.device) -> int:
    """The prefix split-K a CUDA graph of ``batch`` rows fixes at capture, sized for full groups
    (batch / max_members of them: the shared-prefix workloads' shape) over up to max_shared_len."""
    cfg = prefix_config(num_q_heads, num_kv_heads, max_members)
    heads = cfg["heads_per_program"]
    rows = max_members * heads * (num_q_heads // num_kv_heads)
    return choose_prefix_splits(max(1, batch // max_members), num_kv_heads // heads, max_shared_len, rows, heads,
                                elem_size, device, cfg["block_n"])


def cascade_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                             context_lens: torch.Tensor, plan: CascadePlan, scale: float,
                             out: torch.Tensor | None = None, *, max_context: int | None = None,
                             num_splits: int | None = None, prefix_splits: int | None = None,
                             debug: bool | None = None, block_n: int | None = None, num_warps: int | None = None,
                             num_stages: int | None = None, heads_per_program: int | None = None,
                             suffix_block_n: int | None = None, suffix_heads_per_program: int | None = None,
                             overlap: bool | None = None, k_scale=None, v_scale=None, window: int = 0,
                             softcap: float = 0.0) -> torch.Tensor:
    """Decode attention, same arguments and result as ``paged_decode_attention`` plus ``plan``.

    q [B, Hq, D]; k_cache/v_cache [num_pages, page_size, Hkv, D]; page_table int32 [B, P];
    context_lens int32 [B] -> out [B, Hq, D]. ``plan``: ``plan_cascade(...)`` of this batch's page
    table (context lengths may have grown since), moved to q's device. Nothing is read back.

    max_context / num_splits size the suffix's split-K (as in paged_decode_attention; the bound of
    context_lens is also one of the suffix lengths). prefix_splits overrides the prefix split-K;
    block_n, num_warps, num_stages, heads_per_program tune the prefix kernel; suffix_block_n and
    suffix_heads_per_program the suffix (decode) kernel; overlap runs the prefix kernel on a side
    stream (CUDA only; default ``OVERLAP``). debug checks the page table and the plan against this
    batch (synchronises). window > 0 and softcap > 0 raise NotImplementedError: a window makes each
    row's visible keys start at its own position, so rows no longer share the prefix the plan
    groups them by (and a windowed layer's prefix pages may already be released); callers use
    paged_decode_attention for such layers.
    """
    checks.unsupported("cascade_decode_attention", window=window, softcap=softcap)
    b, hq, d = q.shape
    checks.check_attention_shapes(q, k_cache, v_cache, page_table, context_lens, b, "context_lens")
    mode, k_scale, v_scale = kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale, "cascade_decode_attention")
    num_pages, page_size, hkv, _ = k_cache.shape
    if plan.page_size != page_size or plan.num_rows != b:
        raise ValueError(f"cascade_decode_attention: the plan is for {plan.num_rows} rows of page size "
                         f"{plan.page_size}, the batch has {b} rows of page size {page_size}")
    if plan.device != q.device:
        raise ValueError(f"cascade_decode_attention: the plan is on {plan.device}, q on {q.device} (plan.to(device))")
    if checks.debug_enabled(debug):
        checks.check_page_table_values(page_table, context_lens, num_pages, page_size)
        check_plan_values(plan, page_table, context_lens)
    suffix_kw = dict(max_context=max_context, num_splits=num_splits, block_n=suffix_block_n,
                     heads_per_program=suffix_heads_per_program, k_scale=k_scale, v_scale=v_scale)
    if plan.num_groups == 0 or b == 0:
        return _da.paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale, out, **suffix_kw)
    if out is None:
        out = torch.empty_like(q)
    if q.dtype != k_cache.dtype and mode == kv_quant.NONE:
        raise ValueError(f"cascade_decode_attention: q is {q.dtype}, the cache {k_cache.dtype}")
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"cascade_decode_attention: out must be {q.dtype} {tuple(q.shape)} with a contiguous head_dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = hq // hkv
    block_d = triton.next_power_of_2(d)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    upcast = interpreter_bf16(q.dtype, mode)
    offsets = checks.row_offset_flags(k_cache, v_cache)     # both kernels read the pools alike
    row_shared = plan.row_shared_len
    num_cols = page_table.shape[1]

    pcfg = prefix_config(hq, hkv, plan.max_members)
    heads = heads_per_program or pcfg["heads_per_program"]
    dcfg = _da.default_config(hq, hkv, mode)
    s_heads = suffix_heads_per_program or dcfg["heads_per_program"]
    for name, h in (("heads_per_program", heads), ("suffix_heads_per_program", s_heads)):
        if hkv % h:
            raise ValueError(f"cascade_decode_attention: {name} {h} does not divide {hkv} KV heads")
    p_block_n = block_n or pcfg["block_n"]
    s_block_n = suffix_block_n or dcfg["block_n"]
    rows = plan.max_members * heads * group
    block_r = max(16, triton.next_power_of_2(rows))
    if prefix_splits is None:
        prefix_splits = plan.prefix_splits
    if prefix_splits is None:
        prefix_splits = choose_prefix_splits(plan.num_groups, hkv // heads, plan.max_shared_len, rows, heads,
                                             k_cache.element_size(), q.device, p_block_n)
    if max_context is None:
        max_context = num_cols * page_size
    if num_splits is None:
        num_splits = _da.choose_num_splits(b, hkv // s_heads, max_context, q.device, s_block_n)
    # Two allocations for all scratch (host cost matters in eager mode): fp32 partials of both
    # sides, int32 suffix page table and lengths.
    n_pre, n_suf = b * hq * prefix_splits, b * hq * num_splits
    f32 = torch.empty(n_pre * (d + 1) + n_suf * (d + 1), dtype=torch.float32, device=q.device)
    ppo = f32[: n_pre * d].view(b, hq, prefix_splits, d)
    pplse = f32[n_pre * d: n_pre * (d + 1)]
    spo = f32[n_pre * (d + 1): n_pre * (d + 1) + n_suf * d].view(b, hq, num_splits, d)
    splse = f32[n_pre * (d + 1) + n_suf * d:]
    i32 = torch.empty(b * (num_cols + 1), dtype=torch.int32, device=q.device)
    spt = i32[: b * num_cols].view(b, num_cols)
    sctx = i32[b * num_cols:]

    ks, vs, stride_sp, stride_st, kf, vf = scale_launch_args(mode, k_cache, k_scale, v_scale)
    kc, vc = kv_quant.storage_view(k_cache), kv_quant.storage_view(v_cache)

    # (a) prefix: one pass over each group's shared pages, for all its rows
    overlap = (OVERLAP if overlap is None else overlap) and q.device.type == "cuda"
    if overlap:
        # Independent of the suffix: on a side stream it fills the SMs the suffix kernel leaves
        # idle. Joined before the merge, so the partials (allocated on the main stream) are
        # complete before they are read, and not freed before that.
        main = torch.cuda.current_stream(q.device)
        side = _side_stream(q.device)
        side.wait_stream(main)
    with torch.cuda.stream(side) if overlap else contextlib.nullcontext():
        _cascade_prefix_kernel[(hkv // heads, plan.num_groups, prefix_splits)](
            q, kc, vc, ks, vs, ppo, pplse, page_table, plan.group_rows, plan.group_shared_len, scale * kf * LOG2E, vf,
            prefix_splits, hq, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_sp, stride_st, page_table.stride(0),
            MEMBERS=plan.max_members, GROUP=group, HEADS=heads, BLOCK_R=block_r, BLOCK_C=heads * block_d,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=p_block_n, PAGE_SIZE=page_size, PRECISION=precision, UPCAST=upcast,
            KV_QUANT=mode, **offsets,
            num_warps=num_warps or (8 if block_r >= 128 else pcfg["num_warps"]),
            num_stages=num_stages or pcfg["num_stages"],
        )

    # (b) suffix: the decode kernel over each row's pages from shared_len on
    _suffix_table_kernel[(b,)](page_table, context_lens, row_shared, spt, sctx, page_table.stride(0), num_cols,
                               PAGE_SIZE=page_size, BLOCK_P=min(256, triton.next_power_of_2(num_cols)), num_warps=1)
    grid = (hkv // s_heads, b, num_splits) if _da.HEAD_FASTEST else (b, hkv // s_heads, num_splits)
    _da._decode_split_kernel[grid](
        q, kc, vc, ks, vs, out, spo, splse, spt, sctx, scale * kf * LOG2E, vf, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_sp, stride_st, spt.stride(0),
        0, 0.0,                                         # no window, no cap (refused above)
        GROUP=group, HEADS=s_heads, BLOCK_R=max(16, triton.next_power_of_2(group * s_heads)),
        BLOCK_C=s_heads * block_d, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=s_block_n, PAGE_SIZE=page_size, SPLIT=True,
        USE_DOT=True, HEAD_FASTEST=_da.HEAD_FASTEST, PRECISION=precision, UPCAST=upcast, KV_QUANT=mode,
        PAGE_IDS=_da.page_ids_apply(dcfg["page_ids"], page_size, s_block_n),
        **offsets,
        num_warps=dcfg["num_warps"], num_stages=dcfg["num_stages"],
    )

    # (c) exact merge of both partial sets
    if overlap:
        main.wait_stream(side)
    block_h = min(MERGE_HEADS_PER_PROGRAM, triton.next_power_of_2(hq))
    _cascade_merge_kernel[(b, triton.cdiv(hq, block_h))](
        spo, splse, ppo, pplse, row_shared, out, hq, num_splits, prefix_splits, out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=block_h, num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------------------------
# Torch reference (the same decomposition, in fp32/fp64; reads the plan and lengths on the host)
# ----------------------------------------------------------------------------------------------

def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float):
    """q [R, Hq, D], k/v [R, L, Hkv, D], valid [R, L] -> (o [R, Hq, D] normalised, lse [R, Hq] natural log)."""
    r, hq, d = q.shape
    hkv = k.shape[2]
    s = torch.einsum("rhgd,rlhd->rhgl", q.view(r, hkv, hq // hkv, d), k) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                     # -inf where nothing is valid
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    o = torch.einsum("rhgl,rlhd->rhgd", p, v.masked_fill(~valid[:, :, None, None], 0.0))
    return o.reshape(r, hq, d), lse.reshape(r, hq)


def cascade_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                             context_lens: torch.Tensor, plan: CascadePlan, scale: float,
                             out: torch.Tensor | None = None, *, k_scale=None, v_scale=None,
                             **_ignored) -> torch.Tensor:
    """Torch version of cascade_decode_attention: prefix per group, suffix per row, log-sum-exp merge."""
    b = q.shape[0]
    checks.check_attention_shapes(q, k_cache, v_cache, page_table, context_lens, b, "context_lens")
    _, k_scale, v_scale = kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale, "cascade_decode_reference")
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    _, page_size, _, _ = k_cache.shape
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc = q.to(ct)
    lens = context_lens.long().cpu()
    shared = plan.row_shared_len.long().cpu()
    num_pages = k_cache.shape[0]
    # suffix: every row, tokens [shared, ctx)
    n_pages = max(1, -(-int(lens.max()) // page_size))
    pages = page_table[:, :n_pages].long().clamp(0, num_pages - 1)
    k = reference._gather_tokens(k_cache, pages, k_scale, ct)          # [B, L, Hkv, D], dequantized
    v = reference._gather_tokens(v_cache, pages, v_scale, ct)
    pos = torch.arange(n_pages * page_size)[None, :]
    valid = ((pos >= shared[:, None]) & (pos < lens[:, None])).to(q.device)
    o_num, lse_tot = _partial(qc, k, v, valid, scale)
    o_num = o_num.clone()
    # prefix: per group, the shared pages of its first member for all members
    rows_all = plan.group_rows.cpu().tolist()
    for members, n in zip(rows_all, plan.group_shared_len.cpu().tolist()):
        members = [m for m in members if m >= 0]
        if not members or n == 0:
            continue
        gp = page_table[members[0], : n // page_size].long()
        gk = reference._gather_tokens(k_cache, gp[None], k_scale, ct).expand(len(members), -1, -1, -1)
        gv = reference._gather_tokens(v_cache, gp[None], v_scale, ct).expand(len(members), -1, -1, -1)
        idx = torch.tensor(members, device=q.device)
        o_p, lse_p = _partial(qc[idx], gk, gv, torch.ones(len(members), n, dtype=torch.bool, device=q.device), scale)
        lse_s = lse_tot[idx]
        m = torch.maximum(lse_s, lse_p)
        m = torch.where(torch.isinf(m), 0.0, m)
        ws, wp = torch.exp(lse_s - m), torch.exp(lse_p - m)
        o_num[idx] = (ws[..., None] * o_num[idx] + wp[..., None] * o_p) / (ws + wp)[..., None]
        lse_tot[idx] = m + torch.log(ws + wp)
    out.copy_(o_num.nan_to_num_(0.0))
    return out
