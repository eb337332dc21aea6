"""perf/workloads/generate.py: seeded, tokenizer-exact workload files (no server)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.workloads import generate as wgen  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from kvshare.runtime.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def words(tok):
    return wgen.single_token_words(tok)


def test_words_are_single_tokens(tok, words):
    from kvshare.runtime.tokenizer import encode_prompt

    assert len(words) > 1000 and words == sorted(words)
    for w in words[::97]:
        assert len(encode_prompt(tok, " " + w, chat=False)) == 1
        assert len(encode_prompt(tok, w, chat=False)) == 1


def test_same_seed_same_files_other_seed_other_files(tmp_path, tok):
    names = ["seed-12x128", "fixed-1", "seed-hot10"]
    a = wgen.generate(tmp_path / "a", names, seed=0, tokenizer=tok, progress=False)
    b = wgen.generate(tmp_path / "b", names, seed=0, tokenizer=tok, progress=False)
    c = wgen.generate(tmp_path / "c", names, seed=1, tokenizer=tok, progress=False)
    for n in names:
        assert a["workloads"][n]["files"] == b["workloads"][n]["files"]
        assert a["workloads"][n]["files"] != c["workloads"][n]["files"]
        for f in a["workloads"][n]["files"]:
            assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


def test_committed_manifest_reproduces(tmp_path, tok):
    """The checksums in perf/workloads/manifest.json (seed 0, SmolLM2's tokenizer) still come out."""
    want = json.loads(wgen.COMMITTED_MANIFEST.read_text())
    names = ["seed-12x128", "seed-hot10", "fixed-1"]
    got = wgen.generate(tmp_path, names, seed=want["seed"], tokenizer=tok, progress=False)
    for n in names:
        assert got["workloads"][n]["files"] == want["workloads"][n]["files"], n


def test_seed_12x128_shape(tok, words):
    reqs = wgen.build("seed-12x128", tok, words=words)
    assert len(reqs) == 96 and wgen.concurrency_of("seed-12x128") == 12
    assert {len(r.input_ids) for r in reqs} == {128}
    assert {r.max_tokens for r in reqs} == {128}
    assert len({r.prompt for r in reqs}) == 96


def test_seed_hot10_shape(tok, words):
    reqs = wgen.build("seed-hot10", tok, words=words)
    lengths = [len(r.input_ids) for r in reqs]
    assert min(lengths) >= 120 and max(lengths) <= 136
    counts: dict[str, int] = {}
    for r in reqs:
        counts[r.prompt] = counts.get(r.prompt, 0) + 1
    hot = sorted(counts.values(), reverse=True)[:10]
    assert 0.55 < sum(hot) / len(reqs) < 0.8          # ~68% of traffic on 10 prompts
    assert sorted(counts.values(), reverse=True)[10] == 1


def test_prefix_workloads_share_text_and_token_prefixes(tok, words):
    reqs = wgen.build("prefix-repetition", tok, words=words)
    assert {len(r.input_ids) for r in reqs} == {512}
    groups: dict[str, list] = {}
    for r in reqs:
        groups.setdefault(r.group, []).append(r)
    assert len(groups) == 10
    for members in groups.values():
        first = members[0]
        for m in members[1:]:
            assert m.input_ids[:256] == first.input_ids[:256]
            assert m.prompt.split(" ")[:256] == first.prompt.split(" ")[:256]


def test_mixed_is_poisson_open_loop(tok, words):
    reqs = wgen.build("mixed", tok, words=words)
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert wgen.concurrency_of("mixed") is None
    mean_in = sum(len(r.input_ids) for r in reqs) / len(reqs)
    mean_out = sum(r.max_tokens for r in reqs) / len(reqs)
    assert 150 < mean_in < 250 and 130 < mean_out < 230


def test_files_load_in_kvshare_client(tmp_path, tok):
    from kvshare_client.workload import load_workload

    wgen.generate(tmp_path, ["fixed-1"], tokenizer=tok, progress=False)
    text = load_workload(tmp_path / "fixed-1.jsonl")
    ids = load_workload(tmp_path / "fixed-1.ids.jsonl", {"max_tokens": 16})
    assert len(text) == len(ids) == 8
    assert text[0].prompt and text[0].ignore_eos and text[0].min_tokens == text[0].max_tokens == 128
    assert len(ids[0].input_ids) == 128 and ids[0].max_tokens == 16
    from kvshare.runtime.tokenizer import encode_prompt

    assert tuple(encode_prompt(tok, text[0].prompt, chat=False)) == ids[0].input_ids
    sched = [json.loads(line) for line in (tmp_path / "fixed-1.schedule.jsonl").read_text().splitlines()]
    assert [s["index"] for s in sched] == list(range(8)) and all(s["prompt_tokens"] == 128 for s in sched)
