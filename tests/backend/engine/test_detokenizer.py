"""Incremental detokenization with the real SmolLM2 tokenizer: deltas join to the full decode, no
split characters, stop strings never emitted however the text is cut into tokens."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvshare.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello world, this is a test.", "你好，世界！我们今天去公园。", "Emoji 😀🚀🌍 and 👩‍👩‍👧 family",
         "  leading spaces\n\tand tabs", "mixed 中文 text with ümlauts and 🎉"]


def stream(tokenizer, ids, stop=(), check_stop=True):
    d = IncrementalDetokenizer(tokenizer, tuple(stop))
    deltas = [d.add(t, check_stop=check_stop) for t in ids]
    if not d.stopped:
        deltas.append(d.finish())
    return d, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    _, deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text,stop", [("The answer is 42. Done.", "42."), ("你好，世界！我们今天去公园。", "世界"),
                                       ("abc STOP def", " STOP"), ("emoji 🚀 here", "🚀")])
def test_stop_string_cuts_output_before_it(tokenizer, text, stop):
    ids = tokenizer.encode(text, add_special_tokens=False)
    d, deltas = stream(tokenizer, ids, stop=[stop])
    assert d.stopped
    assert "".join(deltas) == text[: text.index(stop)]


def test_stop_ignored_until_allowed(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    d, deltas = stream(tokenizer, ids, stop=["two"], check_stop=False)
    assert not d.stopped and "".join(deltas) == "one two three"


def test_partial_stop_prefix_is_released_when_it_turns_out_not_to_be_a_stop(tokenizer):
    ids = tokenizer.encode("ab abd", add_special_tokens=False)
    d, deltas = stream(tokenizer, ids, stop=["abc"])
    assert not d.stopped and "".join(deltas) == "ab abd"


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab c,.你好世界😀🚀é\n")), min_size=1, max_size=30),
       stop_at=st.integers(0, 29), stop_len=st.integers(1, 4))
def test_property_stop_or_full_text(tokenizer, text, stop_at, stop_len):
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop = full[stop_at: stop_at + stop_len]
    d, deltas = stream(tokenizer, ids, stop=[stop] if stop else [])
    out = "".join(deltas)
    if stop:
        assert d.stopped and out == full[: full.index(stop)]
    else:
        assert out == full
    assert all("\ufffd" not in x for x in deltas) or "\ufffd" in full
