"""Prompt limits (docs/operate/security.md): bytes of text refused before tokenizing, tokens after, both named
by the input; the settings come from KVSHARE_* or the model config's parameters."""
from __future__ import annotations

import numpy as np
import pytest

from kvshare.engine.outputs import InvalidRequest
from kvshare.triton_adapter.inputs import text_prompts
from kvshare.triton_adapter.text_prompt import DEFAULT_MAX_PROMPT_BYTES, PromptLimits, TextPrompter


def texts(*rows: bytes):
    arr = np.array([[r] for r in rows], dtype=object)
    return lambda name: arr if name == "text_input" else None


def test_a_prompt_over_max_prompt_bytes_is_refused_naming_text_input():
    assert text_prompts(texts(b"a" * 10), max_prompt_bytes=10) == ["a" * 10]
    with pytest.raises(InvalidRequest, match=r"^text_input: has 11 bytes, more than max_prompt_bytes \(10\)"):
        text_prompts(texts(b"a" * 11), max_prompt_bytes=10)


def test_the_byte_limit_counts_bytes_not_characters_and_checks_every_row():
    with pytest.raises(InvalidRequest, match="text_input: has 12 bytes"):
        text_prompts(texts(b"ok", "日本語の".encode()), max_prompt_bytes=10)


def test_the_byte_limit_comes_before_decoding():
    # invalid UTF-8 past the limit: the size is what the client hears about, nothing is decoded
    with pytest.raises(InvalidRequest, match="max_prompt_bytes"):
        text_prompts(texts(b"\xff" * 64), max_prompt_bytes=8)


def test_settings_environment_over_parameters_over_defaults():
    assert PromptLimits.from_settings({}, env={}) == PromptLimits(DEFAULT_MAX_PROMPT_BYTES, None)
    assert PromptLimits.from_settings({"max_prompt_bytes": "4096", "max_prompt_tokens": "100"}, env={}) == \
        PromptLimits(4096, 100)
    env = {"KVSHARE_MAX_PROMPT_BYTES": "512", "KVSHARE_MAX_PROMPT_TOKENS": "7"}
    assert PromptLimits.from_settings({"max_prompt_bytes": "4096"}, env=env) == PromptLimits(512, 7)
    assert PromptLimits.from_settings({"max_prompt_tokens": "none"}, env={}).max_tokens is None
    for bad in ("0", "-3", "lots"):
        with pytest.raises(ValueError, match="max_prompt_bytes"):
            PromptLimits.from_settings({"max_prompt_bytes": bad}, env={})


class _CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def _prompter(limits: PromptLimits) -> TextPrompter:
    p = TextPrompter.__new__(TextPrompter)      # without loading a real tokenizer
    p.tokenizer, p.default_chat, p.params, p.limits = _CharTokenizer(), False, {}, limits
    return p


def test_max_prompt_tokens_in_a_text_model_refuses_naming_text_input():
    p = _prompter(PromptLimits(max_bytes=100, max_tokens=4))
    assert p.prompts(texts(b"abcd")) == [[97, 98, 99, 100]]
    with pytest.raises(InvalidRequest, match=r"^text_input: the prompt has 5 tokens, more than max_prompt_tokens \(4\)"):
        p.prompts(texts(b"abcde"))
    with pytest.raises(InvalidRequest, match=r"^text_input: row 1: the prompt has 6 tokens"):
        p.prompts(texts(b"ab", b"abcdef"))
    with pytest.raises(InvalidRequest, match="max_prompt_bytes"):
        _prompter(PromptLimits(max_bytes=3)).prompts(texts(b"abcd"))
