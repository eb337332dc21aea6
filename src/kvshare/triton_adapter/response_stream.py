"""Sends RequestOutputs to Triton clients from a dedicated thread, coalescing when it falls behind.

The engine thread only enqueues; IPC to the Triton stub (~0.1 ms per response) never stalls a step.
When several deltas of one request are queued, they go out as one response.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np

from ..engine.outputs import RequestOutput, coalesce, merge_outputs
from .inputs import GenerationRequest

log = logging.getLogger("kvshare.triton")


@dataclass
class ClientStream:
    """One Triton request's response sender and what its client asked to receive."""
    sender: object
    request: GenerationRequest
    buffered: RequestOutput | None = None   # non-streaming requests send once, at the end


def error_response(pb, message: str, code: str = "INVALID_ARG"):
    """A final error response; code names a pb.TritonError code (INVALID_ARG, INTERNAL, UNAVAILABLE)."""
    try:
        err = pb.TritonError(message, getattr(pb.TritonError, code))
    except (AttributeError, TypeError):   # stubs without error codes
        err = pb.TritonError(message)
    return pb.InferenceResponse(output_tensors=[], error=err)


def overloaded_response(pb, in_flight: int, limit: int):
    return error_response(pb, f"llm_engine is overloaded: {in_flight} requests are already running or queued "
                              f"(max_queued_requests = {limit}); retry later", "UNAVAILABLE")


def build_response(pb, out: RequestOutput, req: GenerationRequest):
    tensors = [
        pb.Tensor("text_output", np.array([[out.text.encode("utf-8")]], dtype=np.object_)),
        pb.Tensor("output_ids", np.array([list(out.token_ids)], dtype=np.int32).reshape(1, -1)),
        pb.Tensor("finish_reason", np.array([[(out.finish_reason or "").encode()]], dtype=np.object_)),
        pb.Tensor("cached_tokens", np.array([[out.cached_tokens]], dtype=np.int32)),
    ]
    if req.return_num_input_tokens:
        tensors.append(pb.Tensor("num_input_tokens", np.array([[out.num_prompt_tokens]], dtype=np.int32)))
    if req.return_num_output_tokens:
        tensors.append(pb.Tensor("num_output_tokens", np.array([[len(out.token_ids)]], dtype=np.int32)))
    return pb.InferenceResponse(output_tensors=tensors)


class ResponsePump:
    def __init__(self, pb):
        self._pb = pb
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, ClientStream] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvshare-responses", daemon=True)
        self._thread.start()

    def register(self, request_id: str, stream: ClientStream) -> None:
        with self._lock:
            self._streams[request_id] = stream

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def put(self, out: RequestOutput) -> None:
        """Called on the engine thread."""
        self._queue.put(out)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            for out in coalesce([o for o in batch if o is not None]):
                self._send(out)
            if stop:
                return

    def _send(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
        if stream is None:
            return
        if not stream.request.stream and not out.finished:
            stream.buffered = out if stream.buffered is None else merge_outputs(stream.buffered, out)
            return
        if stream.buffered is not None:
            out = merge_outputs(stream.buffered, out)
        flags = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
        try:
            if out.finish_reason == "error":
                stream.sender.send(error_response(self._pb, out.error or "generation failed", "INTERNAL"), flags=flags)
            else:
                stream.sender.send(build_response(self._pb, out, stream.request), flags=flags)
        except Exception:
            # The client went away; the engine hears of it through is_cancelled() and frees the pages.
            log.debug("could not send to request %s", out.request_id, exc_info=True)
