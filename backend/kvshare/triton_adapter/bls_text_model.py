"""Triton adapter of `llm_bls`: text in, text deltas out, like `ensemble`, but cancellable.

Triton 2.51 passes a client's cancel into neither a running ensemble step nor a BLS request, so a
cancelled `ensemble` request runs to its end. This decoupled model tokenizes, streams from
`llm_engine` through BLS under a fresh request key, forwards every response, and when its own
client cancels it sends `llm_engine` a control request with that key: the engine ends the request
and frees its pages at once. (TensorRT-LLM ships the same pair: `ensemble` and `tensorrt_llm_bls`.)
"""
from __future__ import annotations

import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from ..engine.outputs import InvalidRequest
from . import contract
from .bls_retention import FinishedStreams
from .logs import configure_logging
from .request_snapshot import RequestSnapshot, snapshot_request
from .response_stream import error_response, only_requested, serve_to_the_end
from .text_prompt import TextPrompter

log = logging.getLogger("kvshare.triton")

ENGINE = "llm_engine"
# Every input llm_bls and llm_engine both declare, as the client sent it (contract.py).
PASSTHROUGH = tuple(contract.forwarded_to_engine(contract.BLS))


def _key_tensor(name: str, key: str, rows: int = 1):
    """[rows, 1]: Triton requires every input of a batched request to have the same batch size."""
    return pb_utils.Tensor(name, np.full((rows, 1), key.encode(), dtype=np.object_))


def _as_text_error(err):
    """llm_engine's error about its input_ids is about this model's text_input (the name the client sent)."""
    message = err.message() if callable(getattr(err, "message", None)) else str(err)
    if not message.startswith("input_ids: "):
        return err
    try:
        return pb_utils.TritonError("text_input: " + message.removeprefix("input_ids: "), err.code())
    except Exception:
        return err


class BLSTextModel:
    def initialize(self, args):
        configure_logging()
        self.prompter = TextPrompter(args["model_config"])
        self.outputs = [o["name"] for o in json.loads(args["model_config"])["output"]]
        # One thread per stream in flight: BLS iteration blocks while the engine generates.
        self.pool = ThreadPoolExecutor(max_workers=int(self.prompter.params.get("max_streams", "1024")),
                                       thread_name_prefix="llm-bls")
        self.finished = FinishedStreams()       # freed with the GIL held (bls_retention.py)

    def execute(self, requests):
        for request in requests:     # read here, on the stub's thread (request_snapshot.py)
            self.pool.submit(self._serve, snapshot_request(request))
        return None

    def finalize(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.finished.clear()

    def _serve(self, request: RequestSnapshot) -> None:
        serve_to_the_end(pb_utils, "llm_bls", request, self._stream, log)

    def _stream(self, request: RequestSnapshot, sender) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            ids, lengths = self.prompter.token_tensors(request.get)    # [B, L] rows, as the ensemble's preprocessing
        except InvalidRequest as exc:
            sender.send(error_response(pb_utils, str(exc)), flags=final)
            return
        key = uuid.uuid4().hex
        if log.isEnabledFor(logging.DEBUG):
            log.debug("llm_bls: request %s goes to llm_engine as key:%s", request.request_id, key)
        inputs = [pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("input_lengths", lengths),
                  _key_tensor("request_key", key, ids.shape[0])]
        for name in PASSTHROUGH:
            array = request.get(name)
            if array is not None:
                inputs.append(pb_utils.Tensor(name, array))
        cancelled = False
        try:
            bls = pb_utils.InferenceRequest(model_name=ENGINE, inputs=inputs, requested_output_names=self.outputs)
            stream = bls.exec(decoupled=True)
            try:
                for response in stream:
                    if response.has_error():
                        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=_as_text_error(response.error())),
                                    flags=final)
                        return
                    if not cancelled and sender.is_cancelled():
                        cancelled = True
                        self._cancel(key)
                    tensors = only_requested(response.output_tensors(), request.requested_outputs)
                    if tensors and not cancelled:
                        sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
            finally:
                self.finished.keep(stream)     # after its last response (bls_retention.py)
        except Exception as exc:  # the engine model went away, or BLS failed: the client still gets an end
            log.exception("llm_bls stream failed")
            sender.send(error_response(pb_utils, f"llm_bls: {exc}", "INTERNAL"), flags=final)
            return
        sender.send(flags=final)

    def _cancel(self, key: str) -> None:
        ctl = pb_utils.InferenceRequest(
            model_name=ENGINE, requested_output_names=[],
            inputs=[pb_utils.Tensor("input_ids", np.zeros((1, 1), dtype=np.int32)), _key_tensor("cancel_request_key", key)])
        stream = ctl.exec(decoupled=True)
        for _ in stream:
            pass
        self.finished.keep(stream)
