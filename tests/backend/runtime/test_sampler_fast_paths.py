"""The sampler's fast paths (pure temperature, top-k window, sort) against the full-sort sampler
they replace: the same filtered distributions, the same draws given the same race noise, the
same frequencies, and each row of a mixed batch keeping its own semantics."""
from __future__ import annotations

import math

import pytest
import torch

from kvshare.runtime import sampler as sampler_mod
from kvshare.runtime.sampler import Sampler, SamplingRow, sample_grouped, top_k_window
from kvshare.sampling_params import SamplingParams


def _reference_filtered(logits, temperature, top_k, top_p):
    """sample_batched as of commit 468b88c (one full sort per row), kept verbatim as the reference up to
    its race: the filtered distribution in sorted order, and that order (the tests race it themselves)."""
    vocab = logits.shape[-1]
    scaled = logits / temperature[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab)).long()
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    return probs.masked_fill(drop, 0.0), order


def _reference_probs(logits, params):
    """The reference's filtered distribution per row, in vocab order."""
    probs, order = _reference_filtered(logits, *_param_tensors(params))
    return torch.zeros_like(probs).scatter(1, order, probs)


def _param_tensors(params):
    return (torch.tensor([p.temperature for p in params]), torch.tensor([p.top_k for p in params]),
            torch.tensor([p.top_p for p in params]))


def _window_probs(logits, params):
    """The top-k window's distribution spread back over the vocabulary (outside ties share their mass)."""
    temperature, top_k, top_p = _param_tensors(params)
    top_p = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, math.inf))
    w = top_k_window(logits, temperature, top_k, top_p, int(top_k.max()))
    probs = torch.zeros_like(logits).scatter(1, w.ids, w.probs)
    ties = torch.diff(w.ties_cum, dim=1, prepend=torch.zeros_like(w.ties_cum[:, :1])).bool()
    share = w.tie_mass / w.ties_cum[:, -1].clamp_min(1)
    return probs + ties * share[:, None]


def _chi2_ok(counts, probs, z=4.5):
    """Pearson's statistic below the Wilson-Hilferty chi-square quantile at z sigmas (p ~ 3e-6)."""
    n = counts.sum()
    probs = probs / probs.sum()          # the race needs no normalisation after top-p, so none was done
    keep = probs > 0
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    if df == 0:
        return True
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit


def _draw_many(logits_row, params, n=20000, seed=0):
    logits = logits_row[None].repeat(n, 1)
    out = sample_grouped(logits, [params] * n, torch.Generator().manual_seed(seed))
    return torch.bincount(out, minlength=logits.shape[1]).double()


_SMALL = torch.tensor([2.0, 0.5, 1.7, -1.0, 0.9, 3.1, -0.3, 1.2, 0.0, 2.4, -2.0, 0.6])
# Four tokens tie at the third value: k = 3 keeps all of them, and a window of 3 holds only one.
_TIED = torch.tensor([0.2, 1.0, 1.0, 3.0, -1.0, 1.0, 2.0, 1.0, -0.5, 0.0])


@pytest.mark.parametrize("logits_row, params", [
    (_SMALL, SamplingParams(temperature=0.7)),
    (_SMALL, SamplingParams(temperature=1.3, top_k=4)),
    (_SMALL, SamplingParams(temperature=1.0, top_k=7, top_p=0.8)),
    (_SMALL, SamplingParams(temperature=0.9, top_p=0.85)),
    (_SMALL, SamplingParams(temperature=1.0, top_k=12)),          # top_k = V: plain temperature
    (_TIED, SamplingParams(temperature=1.0, top_k=3)),
    (_TIED, SamplingParams(temperature=1.0, top_k=3, top_p=0.8)),  # top-p cuts inside the ties
], ids=["temperature", "top_k", "top_k_top_p", "top_p", "top_k_is_vocab", "ties", "ties_top_p"])
def test_frequencies_and_support_match_the_reference(logits_row, params):
    counts = _draw_many(logits_row, params)
    ref = _reference_probs(logits_row[None], [params])[0].double()
    if logits_row is _TIED and params.top_p < 1.0:
        # Which of the tied tokens top-p keeps is the sort's arbitrary order in the reference and a
        # uniform choice here: compare the mass per distinct logit value.
        values = logits_row.unique()
        counts = torch.stack([counts[logits_row == v].sum() for v in values])
        ref = torch.stack([ref[logits_row == v].sum() for v in values])
    assert counts[ref == 0].sum() == 0, "a token the reference filters out was drawn"
    assert _chi2_ok(counts, ref)


def test_ties_past_the_window_are_kept_and_share_the_kth_probability():
    counts = _draw_many(_TIED, SamplingParams(temperature=1.0, top_k=3), seed=7)
    tied = (_TIED == 1.0).nonzero().squeeze(1)
    assert len(tied) == 4 and bool((counts[tied] > 0).all())
    ref = _reference_probs(_TIED[None], [SamplingParams(temperature=1.0, top_k=3)])[0]
    assert torch.allclose(ref[tied], ref[tied[0]].expand(4))         # the reference keeps all four
    assert _chi2_ok(counts, ref.double())


def _random_logits(rows, vocab, seed, ties=False):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    return (logits * 2).round() / 2 if ties else logits


def _mixed_top_k_params(rows, seed):
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(1, 40, (rows,), generator=g).tolist()
    ps = [1.0 if i % 3 == 0 else float(p) for i, p in enumerate(torch.rand(rows, generator=g) * 0.9 + 0.05)]
    ts = [float(t) for t in torch.rand(rows, generator=g) * 1.5 + 0.3]
    return [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in zip(ts, ks, ps)]


def test_window_distribution_equals_the_reference_without_ties():
    logits = _random_logits(64, 500, seed=1)
    params = _mixed_top_k_params(64, seed=2)
    assert torch.allclose(_window_probs(logits, params), _reference_probs(logits, params), atol=1e-6, rtol=1e-5)


def test_window_distribution_keeps_every_tie_at_the_kth_value():
    logits = _random_logits(64, 500, seed=3, ties=True)   # steps of 0.5: the k-th value ties often
    params = [SamplingParams(temperature=p.temperature, top_k=p.top_k) for p in _mixed_top_k_params(64, seed=4)]
    _, top_k, _ = _param_tensors(params)
    kth = logits.sort(-1, descending=True).values.gather(1, (top_k - 1)[:, None])
    assert int(((logits == kth).sum(-1) > 1).sum()) > 20            # the case is exercised
    assert torch.allclose(_window_probs(logits, params), _reference_probs(logits, params), atol=1e-6, rtol=1e-5)


def test_window_distribution_with_ties_and_top_p_has_the_reference_mass_per_logit_value():
    logits = _random_logits(64, 300, seed=5, ties=True)
    params = _mixed_top_k_params(64, seed=6)
    new, ref = _window_probs(logits, params), _reference_probs(logits, params)
    values = logits.unique()
    def per_value(p):
        return torch.stack([(p * (logits == v)).sum(-1) for v in values], dim=1)
    assert torch.allclose(per_value(new), per_value(ref), atol=1e-6, rtol=1e-5)


class _SharedNoise:
    """Stands in for the sampler's Exp(1) noise so that both samplers race with the same E per token."""

    def __init__(self, noise_by_vocab, logits, params):
        self.noise, self.logits, self.params = noise_by_vocab, logits, params

    def __call__(self, shape, device, generator):
        n, v = self.noise.shape
        if shape == (n, v):
            if all(p.top_k == 0 and p.top_p >= 1.0 for p in self.params):
                return self.noise.clone()                          # temperature path: vocab order
            temperature = torch.tensor([p.temperature for p in self.params])
            order = (self.logits / temperature[:, None]).sort(-1, descending=True).indices
            return self.noise.gather(1, order)                     # sort path: sorted order
        k_max = shape[1] - 2                                       # window path: window order, then 2 spare
        ids = self.logits.topk(k_max, dim=-1).indices
        return torch.cat([self.noise.gather(1, ids), torch.ones(n, 2)], dim=1)


@pytest.mark.parametrize("kind", ["temperature", "top_k", "top_p"])
def test_same_noise_gives_the_reference_draw_row_for_row(kind, monkeypatch):
    rows, vocab = 256, 400
    logits = _random_logits(rows, vocab, seed=8)
    logits[:, 5] = float("-inf")                                   # a min_tokens-style mask
    if kind == "temperature":
        params = [SamplingParams(temperature=0.2 + i / rows * 2) for i in range(rows)]
    elif kind == "top_k":
        params = _mixed_top_k_params(rows, seed=9)
    else:
        params = [SamplingParams(temperature=0.5 + i / rows, top_p=0.05 + 0.9 * i / rows) for i in range(rows)]
    noise = torch.empty(rows, vocab).exponential_(generator=torch.Generator().manual_seed(10))
    monkeypatch.setattr(sampler_mod, "_exponential", _SharedNoise(noise, logits, params))
    got = sample_grouped(logits, params)
    # The reference races p / E over sorted positions; with E attached to tokens that is argmax over tokens.
    want = (_reference_probs(logits, params) / noise).argmax(-1)
    assert got.tolist() == want.tolist()
    assert 5 not in got.tolist()


def test_each_path_gets_its_rows(monkeypatch):
    calls = {}
    for name in ("sample_temperature", "sample_top_k", "sample_batched"):
        real = getattr(sampler_mod, name)

        def spy(logits, *args, _real=real, _name=name, **kw):
            calls[_name] = logits.shape[0]
            return _real(logits, *args, **kw)
        monkeypatch.setattr(sampler_mod, name, spy)
    vocab = 3000
    params = [SamplingParams(temperature=1.0), SamplingParams(top_k=vocab), SamplingParams(top_k=50),
              SamplingParams(top_k=50, top_p=0.9), SamplingParams(top_k=sampler_mod.TOP_K_WINDOW_MAX + 1),
              SamplingParams(top_p=0.9), SamplingParams(temperature=0.0), None]
    logits = _random_logits(len(params), vocab, seed=11)
    out = sample_grouped(logits, params, torch.Generator().manual_seed(0))
    assert calls == {"sample_temperature": 2, "sample_top_k": 2, "sample_batched": 2}
    assert out[6] == logits[6].argmax() and out[7] == logits[7].argmax()


def test_logits_are_not_written_and_whole_batches_skip_the_gathers():
    logits = _random_logits(8, 100, seed=12)
    before = logits.clone()
    for params in ([SamplingParams()] * 8, [SamplingParams(top_k=5)] * 8, [SamplingParams(top_p=0.5)] * 8,
                   [SamplingParams(), SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams()] * 2):
        out = sample_grouped(logits, params, torch.Generator().manual_seed(1))
        assert out.shape == (8,) and out.dtype == torch.long
    assert torch.equal(logits, before)


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = _random_logits(64, 1000, seed=13)
    params = ([SamplingParams(temperature=0.8), SamplingParams(top_k=20), SamplingParams(top_p=0.9),
               SamplingParams(top_k=30, top_p=0.8)] * 16)
    a = sample_grouped(logits, params, torch.Generator().manual_seed(5))
    b = sample_grouped(logits, params, torch.Generator().manual_seed(5))
    c = sample_grouped(logits, params, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    rows = [SamplingRow(p, None, [1], []) for p in params]
    assert Sampler((2,), seed=3)(logits, rows) == Sampler((2,), seed=3)(logits, rows)


def test_mixed_batch_keeps_each_rows_semantics():
    vocab, copies, eos = 16, 3000, 4
    row = torch.tensor([1.5, 0.2, 2.2, -0.4, 2.6, 0.9, 1.1, -1.3, 0.0, 1.9, 0.4, -0.8, 1.7, 0.6, 2.0, -2.0])
    kinds = {
        "greedy": SamplingParams(temperature=0.0),
        "temperature": SamplingParams(temperature=0.8),
        "top_k": SamplingParams(temperature=1.2, top_k=3),
        "top_p": SamplingParams(temperature=1.0, top_p=0.6),
        "top_k_top_p": SamplingParams(temperature=1.0, top_k=6, top_p=0.7),
        "min_tokens": SamplingParams(temperature=1.0, min_tokens=5),        # eos masked: the adjusted path
        "seeded": SamplingParams(temperature=0.9, top_k=5, seed=1),
    }
    names = list(kinds) * copies
    rows = [SamplingRow(kinds[n], torch.Generator().manual_seed(i) if n == "seeded" else None, [1], [])
            for i, n in enumerate(names)]
    logits = row[None].repeat(len(rows), 1)
    out = torch.tensor(Sampler((eos,), seed=0)(logits, rows))
    names_t = torch.tensor([list(kinds).index(n) for n in names])
    for j, (name, params) in enumerate(kinds.items()):
        drawn = out[names_t == j]
        if name == "greedy":
            assert bool((drawn == row.argmax()).all())
            continue
        masked = row.clone()
        if name == "min_tokens":
            masked[eos] = float("-inf")
        ref = _reference_probs(masked[None], [params])[0].double()
        counts = torch.bincount(drawn, minlength=vocab).double()
        assert counts[ref == 0].sum() == 0, name
        assert _chi2_ok(counts, ref), name
    seeded = [i for i, n in enumerate(names) if n == "seeded"][:5]
    for i in seeded:                     # a seeded row draws from its own generator whatever its batch
        alone = Sampler((eos,), seed=9)(logits[i:i + 1], [SamplingRow(kinds["seeded"], torch.Generator().manual_seed(i),
                                                                      [1], [])])
        assert out[i] == alone[0]


def test_greedy_ids_from_the_graph_stay_for_greedy_rows_of_a_sampled_batch():
    logits = _random_logits(4, 50, seed=14)
    rows = [SamplingRow(SamplingParams(temperature=0.0), None, [1], []),
            SamplingRow(SamplingParams(temperature=1.0, top_k=1), None, [1], [])] * 2
    graph_ids = torch.tensor([7, 8, 9, 10])
    out = Sampler((2,))(logits, rows, greedy_ids=graph_ids)
    assert out[0] == 7 and out[2] == 9
    assert out[1] == int(logits[1].argmax()) and out[3] == int(logits[3].argmax())


# The H200 sampler benchmark (perf/results/kernels/2026-11-30/sampler.log): batch, vocab, mode, whether
# the grouped paths beat the one sort. use_one_sort must pick the faster side at every measured point.
_H200 = [(12, 32000, "top_k", False), (64, 32000, "top_k", False), (256, 32000, "top_k", True),
         (12, 128256, "top_k", False), (64, 128256, "top_k", True), (256, 128256, "top_k", True),
         (12, 32000, "mixed", False), (64, 32000, "mixed", False), (256, 32000, "mixed", False),
         (12, 128256, "mixed", False), (64, 128256, "mixed", False), (256, 128256, "mixed", True)]
_SPLIT = {"temperature": (4, 0, 0), "top_k": (0, 4, 0), "top_p": (0, 0, 4), "mixed": (1, 2, 1)}   # rows per path, of 4


@pytest.mark.parametrize("batch,vocab,mode,grouped_faster", _H200 + [
    (b, v, m, True) for b in (12, 64, 256) for v in (32000, 128256) for m in ("temperature", "top_p")])
def test_one_sort_on_cuda_exactly_where_it_was_faster(batch, vocab, mode, grouped_faster):
    n_t, n_w, n_s = (batch * k // 4 for k in _SPLIT[mode])
    assert sampler_mod.use_one_sort("cuda", n_t, n_w, n_s, vocab) is (not grouped_faster)
    assert sampler_mod.use_one_sort("cpu", n_t, n_w, n_s, vocab) is False      # the CPU groups always


def test_one_sort_keeps_each_rows_semantics(monkeypatch):
    """What CUDA runs for a small mixed batch: every random row through sample_batched."""
    monkeypatch.setattr(sampler_mod, "use_one_sort", lambda *a: True)
    calls = []
    real = sampler_mod.sample_batched
    monkeypatch.setattr(sampler_mod, "sample_batched", lambda logits, *a, **k: calls.append(logits.shape[0]) or
                        real(logits, *a, **k))
    kinds = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=3),
             SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.0)]
    copies = 4000
    logits = _SMALL[None].repeat(len(kinds) * copies, 1)
    out = sample_grouped(logits, kinds * copies, torch.Generator().manual_seed(2))
    assert calls == [3 * copies]                       # one sort for the random rows, greedy kept
    for j, params in enumerate(kinds):
        drawn = out[j::len(kinds)]
        if params.greedy:
            assert bool((drawn == _SMALL.argmax()).all())
            continue
        ref = _reference_probs(_SMALL[None], [params])[0].double()
        counts = torch.bincount(drawn, minlength=_SMALL.shape[0]).double()
        assert counts[ref == 0].sum() == 0 and _chi2_ok(counts, ref)
