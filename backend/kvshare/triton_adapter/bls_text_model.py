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
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

from ..engine.outputs import InvalidRequest
from . import contract
from .bls_stream import EngineCall, EngineLink, EngineStream
from .logs import configure_logging
from .request_snapshot import RequestSnapshot, snapshot_request
from .response_stream import error_response, only_requested, serve_to_the_end
from .text_prompt import TextPrompter

log = logging.getLogger("kvshare.triton")

ENGINE = "llm_engine"
# Every input llm_bls and llm_engine both declare, as the client sent it (contract.py).
PASSTHROUGH = tuple(contract.forwarded_to_engine(contract.BLS))


def _as_text_error(err):
    """llm_engine's error about its input_ids is about this model's text_input (the name the client sent)."""
    message = err.message() if callable(getattr(err, "message", None)) else str(err)
    if not message.startswith("input_ids: "):
        return err
    try:
        return pb_utils.TritonError("text_input: " + message.removeprefix("input_ids: "), err.code())
    except Exception:
        return err


class ForwardedResponses:
    """llm_engine's responses forwarded as they are (bls_stream.Translation): the tensors the client
    asked for, nothing once it cancelled; the final flag alone at the end."""

    def __init__(self, sender, requested: frozenset[str]):
        self._sender = sender
        self._requested = requested

    def take(self, response, stream: EngineStream) -> None:
        if response.has_error():
            stream.send_final(pb_utils.InferenceResponse(output_tensors=[], error=_as_text_error(response.error())))
            return
        # polled per response: a cancelled client's request ends at llm_engine's next token
        if not stream.cancelled and self._sender.is_cancelled():
            stream.cancel()
        # only what the client asked for: Triton 2.51 would drop the rest without the GIL
        # (response_stream.only_requested)
        tensors = only_requested(response.output_tensors(), self._requested)
        if tensors and not stream.cancelled:
            stream.send(pb_utils.InferenceResponse(output_tensors=tensors))

    def end(self, stream: EngineStream) -> None:
        stream.send_final()

    def before_final(self) -> None:
        pass


class BLSTextModel:
    def initialize(self, args):
        configure_logging()
        self.prompter = TextPrompter(args["model_config"])
        self.outputs = tuple(o["name"] for o in json.loads(args["model_config"])["output"])
        # One thread per stream in flight: BLS iteration blocks while the engine generates.
        self.pool = ThreadPoolExecutor(max_workers=int(self.prompter.params.get("max_streams", "1024")),
                                       thread_name_prefix="llm-bls")
        self.engine = EngineLink(pb_utils, ENGINE, "llm_bls")

    def execute(self, requests):
        for request in requests:     # read here, on the stub's thread (request_snapshot.py)
            self.pool.submit(self._serve, snapshot_request(request))
        return None

    def finalize(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    def _serve(self, request: RequestSnapshot) -> None:
        serve_to_the_end(pb_utils, "llm_bls", request, self._stream, log)

    def _stream(self, request: RequestSnapshot, sender) -> None:
        try:
            ids, lengths = self.prompter.token_tensors(request.get)    # [B, L] rows, as the ensemble's preprocessing
        except InvalidRequest as exc:
            sender.send(error_response(pb_utils, str(exc)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        inputs = [("input_ids", ids), ("input_lengths", lengths)]
        inputs += [(name, array) for name in PASSTHROUGH if (array := request.get(name)) is not None]
        call = EngineCall(inputs=tuple(inputs), outputs=self.outputs, rows=ids.shape[0])
        EngineStream(self.engine, call, sender, request.request_id).run(
            ForwardedResponses(sender, request.requested_outputs))
