"""Text-model requests to token ids: shared by `preprocessing` (ensemble) and `llm_bls`.

No Triton imports: the adapters hand in a getter over their request's inputs.
"""
from __future__ import annotations

import json
import os

from ..engine.outputs import InvalidRequest
from ..runtime.tokenizer import encode_prompt, load_tokenizer
from .inputs import Getter, sampling_params, text_input


class TextPrompter:
    """The served model's tokenizer plus the model config's chat-template default."""

    def __init__(self, model_config_json: str):
        config = json.loads(model_config_json)
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.tokenizer = load_tokenizer(os.environ.get("KVSHARE_MODEL") or params.get("model") or None)
        self.default_chat = params.get("apply_chat_template", "false").lower() == "true"
        self.params = params

    def prompt_ids(self, get: Getter) -> list[int]:
        """Validates the whole request (errors name the field) before tokenizing its text."""
        text = text_input(get)
        sampling_params(get, default_max_tokens=1)   # fail fast; the engine reads them again
        chat = get("apply_chat_template")
        use_chat = self.default_chat if chat is None else bool(chat.reshape(-1)[0])
        try:
            return encode_prompt(self.tokenizer, text, chat=use_chat)
        except ValueError as exc:
            raise InvalidRequest("apply_chat_template", str(exc)) from None
