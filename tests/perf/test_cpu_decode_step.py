"""perf/engine/cpu_decode_step.py's breakdown of a step by kind of op (torch.profiler)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from perf.engine.cpu_decode_step import op_kind, step_breakdown


def test_ops_are_sorted_into_the_kinds_a_decode_step_is_made_of():
    assert op_kind("mkldnn::_linear_pointwise") == op_kind("aten::addmm") == "linear"
    assert op_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert op_kind("aten::index_select") == op_kind("aten::cat") == "kv gather"
    assert op_kind("aten::silu") == op_kind("aten::mul") == "other"


def test_a_step_of_known_ops_shows_up_under_their_kinds():
    x, w = torch.randn(64, 256), torch.randn(1024, 256)
    q = k = v = torch.randn(2, 4, 64, 32)
    cache = torch.randn(4096, 32)
    pages = torch.randint(0, 4096, (2048,))

    def step():
        F.scaled_dot_product_attention(q, k, v)
        cache.index_select(0, pages)
        torch.relu(F.linear(x, w))

    kinds = step_breakdown(step, steps=3)
    assert set(kinds) == {"linear", "attention", "kv gather", "other"}
    assert all(ms > 0 for ms in kinds.values()), kinds
