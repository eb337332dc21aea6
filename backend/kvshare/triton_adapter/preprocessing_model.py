"""Triton adapter of the `preprocessing` model: text (optionally chat-templated) to token ids.

It receives every input of `ensemble` (Triton 2.51's ensemble quirks: see the generator), validates
the whole request (errors name the field), and outputs input_ids INT32 [B, max_len] (rows padded
with 0) and input_lengths INT32 [B, 1] for llm_engine.
"""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

from ..engine.outputs import InvalidRequest
from .logs import configure_logging
from .response_stream import error_response
from .text_prompt import TextPrompter


class PreprocessingModel:
    def initialize(self, args):
        configure_logging()
        self.prompter = TextPrompter(args["model_config"])

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        try:
            tensors = {t.name(): t for t in request.inputs()}
        except Exception:  # a request with no inputs at all (the ensemble forwards it as is)
            tensors = {}

        def get(name):
            t = tensors.get(name)
            return None if t is None else t.as_numpy()

        try:
            ids, lengths = self.prompter.token_tensors(get)
        except InvalidRequest as exc:
            return error_response(pb_utils, str(exc))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("input_lengths", lengths)])
