"""BeamSearch's selection on hand-made candidates (no model): HF transformers' rules, step by step."""
from __future__ import annotations

import math

import pytest

from kvshare.engine.beam_search import NEG, BeamSearch

EOS = 9


def lp(p: float) -> float:
    return math.log(p)


def test_first_step_expands_the_prompt_into_the_best_two_continuations():
    search = BeamSearch(2, max_tokens=5, end_ids=frozenset({EOS}))
    search.step([[(1, lp(0.5)), (2, lp(0.3)), (3, lp(0.1)), (4, lp(0.05))]])
    assert [b.token_ids for b in search.running] == [(1,), (2,)]
    assert not search.done and search.best(2) == []


def test_an_ending_candidate_among_the_first_width_becomes_a_finished_hypothesis():
    search = BeamSearch(2, max_tokens=5, end_ids=frozenset({EOS}), length_penalty=1.0)
    search.step([[(EOS, lp(0.6)), (2, lp(0.3)), (3, lp(0.05)), (4, lp(0.05))]])
    # EOS is the best candidate: a hypothesis of length 1, and the search goes on with the next two
    assert [h.beam.token_ids for h in search.best(2)] == [(EOS,)]
    assert search.best(2)[0].score == pytest.approx(lp(0.6) / 1)
    assert [b.token_ids for b in search.running] == [(2,), (3,)]


def test_the_length_limit_ends_every_candidate_and_ranks_by_length_penalised_score():
    search = BeamSearch(2, max_tokens=2, end_ids=frozenset({EOS}), length_penalty=2.0)
    search.step([[(1, lp(0.5)), (2, lp(0.4)), (3, lp(0.05)), (4, lp(0.05))]])
    search.step([[(5, lp(0.5)), (6, lp(0.3)), (7, lp(0.1)), (8, lp(0.1))],
                 [(7, lp(0.9)), (8, lp(0.05)), (5, lp(0.03)), (6, lp(0.02))]])
    assert search.done
    best = search.best(2)
    # 0.4 * 0.9 = 0.36 beats 0.5 * 0.5 = 0.25: the second beam's continuation comes first
    assert [h.beam.token_ids for h in best] == [(2, 7), (1, 5)]
    assert best[0].score == pytest.approx((lp(0.4) + lp(0.9)) / 2 ** 2.0)
    assert all(a.score >= b.score for a, b in zip(best, best[1:]))


def test_empty_slots_start_impossible_and_a_width_below_two_is_refused():
    assert BeamSearch(3, max_tokens=4, end_ids=frozenset()).finished[0].score == NEG
    with pytest.raises(ValueError):
        BeamSearch(1, max_tokens=4, end_ids=frozenset())
