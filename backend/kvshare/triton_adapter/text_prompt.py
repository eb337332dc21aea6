"""Text-model requests to token ids: shared by `preprocessing` (ensemble) and `llm_bls`.

No Triton imports: the adapters hand in a getter over their request's inputs.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ..engine.outputs import InvalidRequest
from ..runtime.tokenizer import encode_prompt, load_tokenizer, stop_token_ids
from .inputs import Getter, batch_rows, text_prompts


# A prompt's text is refused past this many bytes before it is tokenized: ~25x the embedded model's
# 8192-token context at ~5 bytes a token, and tokenizing 1 MiB already takes ~2 s of a CPU core.
DEFAULT_MAX_PROMPT_BYTES = 1 << 20


@dataclass(frozen=True)
class PromptLimits:
    """Per prompt: bytes of text (checked before tokenizing) and tokens (None: llm_engine's context
    decides, and its refusal names input_ids; set, the text model refuses naming text_input)."""
    max_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    max_tokens: int | None = None

    @classmethod
    def from_settings(cls, params: dict[str, str], env: dict[str, str] | None = None) -> "PromptLimits":
        """KVSHARE_MAX_PROMPT_BYTES / KVSHARE_MAX_PROMPT_TOKENS, else the model config's max_prompt_bytes /
        max_prompt_tokens parameters (llm_engine reads the same KVSHARE_MAX_PROMPT_TOKENS)."""
        env = os.environ if env is None else env

        def setting(name: str) -> int | None:
            raw = env.get(f"KVSHARE_{name.upper()}") or params.get(name) or ""
            if raw.strip().lower() in ("", "none"):
                return None
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {raw!r}") from None
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
            return value

        max_bytes = setting("max_prompt_bytes")
        return cls(max_bytes=DEFAULT_MAX_PROMPT_BYTES if max_bytes is None else max_bytes,
                   max_tokens=setting("max_prompt_tokens"))


class TextPrompter:
    """The served model's tokenizer plus the model config's chat-template default and prompt limits."""

    def __init__(self, model_config_json: str):
        config = json.loads(model_config_json)
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        source = os.environ.get("KVSHARE_MODEL") or params.get("model") or None
        self.tokenizer = load_tokenizer(source)
        # the ids the engine stops at (tokenizer EOS + generation_config.json's list: Llama 3's
        # <|eot_id|>, Gemma's <end_of_turn>, Qwen's <|im_end|>)
        self.stop_ids = stop_token_ids(source, self.tokenizer)
        self.default_chat = params.get("apply_chat_template", "false").lower() == "true"
        self.limits = PromptLimits.from_settings(params)
        self.params = params

    def prompts(self, get: Getter) -> list[list[int]]:
        """The token ids of each of the request's B rows.

        Validates the whole request first (every input of every row; errors name the field), then
        tokenizes: a bad max_tokens is refused before any text is tokenized.
        """
        texts = text_prompts(get, max_prompt_bytes=self.limits.max_bytes)
        rows = batch_rows(get, len(texts))
        out = []
        for b, (text, row) in enumerate(zip(texts, rows)):
            chat = row("apply_chat_template")
            use_chat = self.default_chat if chat is None else bool(chat.reshape(-1)[0])
            try:
                ids = encode_prompt(self.tokenizer, text, chat=use_chat)
            except ValueError as exc:
                raise InvalidRequest("apply_chat_template", str(exc)) from None
            limit = self.limits.max_tokens
            if limit is not None and len(ids) > limit:
                where = "" if len(texts) == 1 else f"row {b}: "
                raise InvalidRequest("text_input", f"{where}the prompt has {len(ids)} tokens, more than "
                                                   f"max_prompt_tokens ({limit})")
            out.append(ids)
        return out

    def token_tensors(self, get: Getter) -> tuple[np.ndarray, np.ndarray]:
        """llm_engine's input_ids INT32 [B, max_len] (rows padded with 0) and input_lengths INT32 [B, 1]."""
        return pad_rows(self.prompts(get))

    def prompt_ids(self, get: Getter) -> list[int]:
        """A one-row request's token ids (a [B>1] request is refused: use prompts / token_tensors)."""
        ids = self.prompts(get)
        if len(ids) != 1:
            raise InvalidRequest("text_input", f"this model takes one prompt per request, got {len(ids)}")
        return ids[0]


def pad_rows(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int32)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = r
    return ids, np.array([[len(r)] for r in rows], dtype=np.int32)
