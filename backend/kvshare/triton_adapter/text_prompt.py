"""Text-model requests to token ids: shared by `preprocessing` (ensemble) and `llm_bls`.

No Triton imports: the adapters hand in a getter over their request's inputs.
"""
from __future__ import annotations

import json
import os

import numpy as np

from ..engine.outputs import InvalidRequest
from ..runtime.tokenizer import encode_prompt, load_tokenizer
from .inputs import Getter, batch_rows, text_prompts


class TextPrompter:
    """The served model's tokenizer plus the model config's chat-template default."""

    def __init__(self, model_config_json: str):
        config = json.loads(model_config_json)
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.tokenizer = load_tokenizer(os.environ.get("KVSHARE_MODEL") or params.get("model") or None)
        self.default_chat = params.get("apply_chat_template", "false").lower() == "true"
        self.params = params

    def prompts(self, get: Getter) -> list[list[int]]:
        """The token ids of each of the request's B rows.

        Validates the whole request first (every input of every row; errors name the field), then
        tokenizes: a bad max_tokens is refused before any text is tokenized.
        """
        texts = text_prompts(get)
        rows = batch_rows(get, len(texts))
        out = []
        for text, row in zip(texts, rows):
            chat = row("apply_chat_template")
            use_chat = self.default_chat if chat is None else bool(chat.reshape(-1)[0])
            try:
                out.append(encode_prompt(self.tokenizer, text, chat=use_chat))
            except ValueError as exc:
                raise InvalidRequest("apply_chat_template", str(exc)) from None
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
