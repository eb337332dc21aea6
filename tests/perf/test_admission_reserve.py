"""perf/core/admission_reserve.py: the reserve rules replayed through the real Scheduler (no model)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.core import admission_reserve as ar  # noqa: E402


def test_at_page_128_a_page_each_holds_fixed_256_back_and_the_growth_reserve_does_not():
    w = ar.WORKLOADS[0]
    assert w.trace == "fixed-256"
    page_each, growth = ar.replay(w, 128, reserve_tokens=128), ar.replay(w, 128, reserve_tokens=ar.RESERVE_TOKENS)
    at_16 = ar.replay(w, 16, reserve_tokens=16)
    assert page_each.steps > 1.5 * growth.steps and page_each.first_token_p95 > 10 * growth.first_token_p95
    assert (growth.steps, growth.first_token_p95) == (at_16.steps, at_16.first_token_p95)


def test_the_table_shows_one_rule_up_to_page_16_and_both_above(capsys):
    ar.main(["--requests", "24", "--page-sizes", "16,64"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["workload", "page", "reserve"]
    rows = [ln.split()[:3] for ln in lines[1:]]
    assert len(rows) == 3 * len(ar.WORKLOADS)
    assert ["fixed-256", "16", "16"] in rows and ["fixed-256", "64", "page"] in rows and ["fixed-256", "64", "16"] in rows
