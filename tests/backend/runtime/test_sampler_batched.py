"""The batched device sampler: filters equal the per-row path's, draws follow the distribution."""
from __future__ import annotations

import torch

from kvshare.runtime.sampler import Sampler, SamplingRow, sample_batched
from kvshare.sampling_params import SamplingParams


def _t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    got = sample_batched(logits, _t([1.0, 2.0, 0.5] * 2), _t([1, 1, 1, 0, 0, 0], torch.long),
                         _t([1.0, 1.0, 1.0, 1e-6, 1e-6, 1e-6]), gen)
    assert got.tolist() == logits.argmax(-1).tolist()


def test_draws_stay_inside_top_k_and_follow_the_probabilities():
    logits = _t([[0.0, 3.0, 2.0, 1.0, -1.0]]).repeat(20000, 1)
    gen = torch.Generator().manual_seed(2)
    s = sample_batched(logits, torch.ones(20000), torch.full((20000,), 2, dtype=torch.long), torch.ones(20000), gen)
    counts = torch.bincount(s, minlength=5).float() / 20000
    assert counts[0] == counts[3] == counts[4] == 0
    p = torch.softmax(_t([3.0, 2.0]), 0)
    assert abs(counts[1] - p[0]) < 0.02 and abs(counts[2] - p[1]) < 0.02


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    probs = _t([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(5000, 1)
    gen = torch.Generator().manual_seed(3)
    s = sample_batched(logits, torch.ones(5000), torch.zeros(5000, dtype=torch.long), torch.full((5000,), 0.7), gen)
    assert set(s.tolist()) == {0, 1}     # 0.5 < 0.7 <= 0.8: tokens 0 and 1 only


def test_sampler_mixes_greedy_batched_and_seeded_rows():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(4))
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=1.0, top_k=1)
    seeded = SamplingParams(temperature=0.7, seed=5)
    rows = [SamplingRow(greedy, None, [1], []), SamplingRow(hot, None, [1], []),
            SamplingRow(seeded, torch.Generator().manual_seed(5), [1], []), SamplingRow(greedy, None, [1], [])]
    out = Sampler((2,), seed=0)(logits, rows)
    am = logits.argmax(-1).tolist()
    assert out[0] == am[0] and out[1] == am[1] and out[3] == am[3]
    alone = Sampler((2,), seed=9)(logits[2:3], [SamplingRow(seeded, torch.Generator().manual_seed(5), [1], [])])
    assert out[2] == alone[0]            # a seeded row's draw does not depend on its batch


def test_greedy_ids_from_the_graph_are_used_as_is():
    logits = torch.randn(3, 10)
    rows = [SamplingRow(SamplingParams(temperature=0.0), None, [1], [])] * 3
    assert Sampler((2,))(logits, rows, greedy_ids=torch.tensor([7, 8, 9])) == [7, 8, 9]
