"""EndIdBan: min_tokens' end-id ban on the device equals the reference (end ids at -inf in the
banned rows, then argmax), for any rows, end ids and logits; two slots in turn keep earlier steps'
bans from leaking into later ones."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.runtime.end_id_ban import EndIdBan


def reference(logits: torch.Tensor, rows, end_ids) -> torch.Tensor:
    out = logits.clone()
    for r in rows:
        out[r, list(end_ids)] = float("-inf")
    return out.argmax(dim=-1)


@st.composite
def steps(draw):
    vocab = draw(st.integers(4, 40))
    end_ids = draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=3))
    max_rows = draw(st.integers(1, 12))
    seq = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, max_rows))
        rows = sorted(draw(st.sets(st.integers(0, n - 1))))
        seq.append((n, rows, draw(st.integers(0, 2**31 - 1))))
    return vocab, end_ids, max_rows, seq


@settings(max_examples=60, deadline=None)
@given(steps())
def test_ban_equals_the_reference_step_after_step(case):
    vocab, end_ids, max_rows, seq = case
    ban = EndIdBan(tuple(end_ids), max_rows, torch.device("cpu"))
    for n, rows, seed in seq:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(n, vocab, generator=g)
        # make an end id the favourite of every row, banned or not: the ban alone decides
        logits[:, min(end_ids)] += 100.0
        want = reference(logits, rows, end_ids)
        got = ban.argmax(logits.clone(), rows)
        assert got.tolist() == want.tolist()
        unbanned = [r for r in range(n) if r not in rows]
        assert all(got[r].item() == min(end_ids) for r in unbanned)
        assert all(got[r].item() not in end_ids for r in rows)


def test_covers_only_bans_of_the_models_own_end_ids():
    ban = EndIdBan((2, 7), 4, torch.device("cpu"))
    assert ban.covers([(0, None), (3, (7, 2))])
    assert not ban.covers([(0, None), (1, (2,))])       # a request's own end ids: the general path
    assert not EndIdBan((), 4, torch.device("cpu")).covers([(0, None)])
