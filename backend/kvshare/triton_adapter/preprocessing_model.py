"""Triton adapter of the `preprocessing` model: text (optionally chat-templated) to token ids."""
from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from ..engine.outputs import InvalidRequest
from .response_stream import error_response
from .text_prompt import TextPrompter


class PreprocessingModel:
    def initialize(self, args):
        self.prompter = TextPrompter(args["model_config"])

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
            ids = self.prompter.prompt_ids(get)
        except InvalidRequest as exc:
            return error_response(pb_utils, str(exc))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32))])
