"""Triton adapter of the `preprocessing` model: text (optionally chat-templated) to token ids."""
from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from ..engine.outputs import InvalidRequest
from ..runtime.tokenizer import encode_prompt, load_tokenizer
from .inputs import sampling_params, text_input
from .response_stream import error_response


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
            try:
                t = pb_utils.get_input_tensor_by_name(request, name)
            except Exception:  # a request with no inputs at all (the ensemble forwards it as is)
                return None
            return None if t is None else t.as_numpy()

        try:
            text = text_input(get)
            sampling_params(get, default_max_tokens=1)   # fail fast, before tokenizing; the engine re-reads them
            chat = get("apply_chat_template")
            use_chat = self.default_chat if chat is None else bool(chat.reshape(-1)[0])
            ids = self._tokenize(text, use_chat)
        except InvalidRequest as exc:
            return error_response(pb_utils, str(exc))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32))])

    def _tokenize(self, text: str, chat: bool) -> list[int]:
        try:
            return encode_prompt(self.tokenizer, text, chat=chat)
        except ValueError as exc:
            raise InvalidRequest("apply_chat_template", str(exc)) from None
