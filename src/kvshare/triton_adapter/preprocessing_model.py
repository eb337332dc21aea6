"""Triton adapter of the `preprocessing` model: text (optionally chat-templated) to token ids."""
from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from ..engine.outputs import InvalidRequest
from ..runtime.weights import default_model_source
from .inputs import text_input
from .response_stream import error_response


def load_tokenizer(source: str | None):
    from pathlib import Path

    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(source or default_model_source())
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


class PreprocessingModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        source = os.environ.get("KVSHARE_MODEL") or params.get("model") or None
        self.tokenizer = load_tokenizer(source)
        self.default_chat = params.get("apply_chat_template", "false").lower() == "true"

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        def get(name):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        try:
            text = text_input(get)
            chat = get("apply_chat_template")
            use_chat = self.default_chat if chat is None else bool(chat.reshape(-1)[0])
            ids = self._tokenize(text, use_chat)
        except InvalidRequest as exc:
            return error_response(pb_utils, str(exc))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32))])

    def _tokenize(self, text: str, chat: bool) -> list[int]:
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidRequest("apply_chat_template", "this model has no chat template")
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                           add_generation_prompt=True, return_dict=False))
        return list(self.tokenizer.encode(text, add_special_tokens=True))
