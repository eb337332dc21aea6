"""A client request answered from `llm_engine` over BLS: what `vllm_model` and `llm_bls` share.

Each of those models keeps only its translation (its inputs -> llm_engine's tensors, an EngineCall;
llm_engine's responses -> its outputs, a Translation). The rest is here, the same for both:

- each request goes to llm_engine under a fresh request key, as one decoupled BLS stream;
- cancelling is llm_engine's control request with that key (cancel_request_key), and for n > 1 one
  per fork (llm_engine names them <key>/0.<s> and cancels by exact id); at most once per request;
- every BLS stream, the control requests' too, is kept HOLD_S once it ends before it is freed
  (bls_retention.py: freed on the stub's thread, without the GIL, its tensors corrupt the allocator);
- the stream is read to its end whatever the client got: after an error or a cancel llm_engine ends
  the request itself, and a stream kept before its last response is not safe to free later;
- exactly one final response per request: the translation's, or an INTERNAL error when BLS fails
  (llm_engine is then told to cancel). The final is marked sent before it goes out, so a send that
  raises is not retried here: response_stream.serve_to_the_end's backstop ends that request.
"""
from __future__ import annotations

import logging
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

import numpy as np

from .bls_retention import FinishedStreams
from .response_stream import error_response

log = logging.getLogger("kvshare.triton")


@dataclass(frozen=True)
class EngineCall:
    """What one client request asks of llm_engine, besides its request key."""
    inputs: tuple[tuple[str, np.ndarray], ...]     # llm_engine input name -> array
    outputs: tuple[str, ...]                       # the llm_engine outputs to ask for
    rows: int = 1                # the request's batch size: Triton wants request_key with as many rows
    sequences: int = 1           # n: above 1 llm_engine forks the request, and each fork has its own id

    def cancel_keys(self, key: str) -> tuple[str, ...]:
        forks = tuple(f"{key}/0.{s}" for s in range(self.sequences)) if self.sequences > 1 else ()
        return (key,) + forks


class EngineLink:
    """One model's BLS link to llm_engine: its streams and control requests, each kept once it ends."""

    def __init__(self, pb, model_name: str, owner: str):
        self.pb = pb                    # triton_python_backend_utils (passed in: tests serve a fake one)
        self.model_name = model_name    # llm_engine's name in the repository
        self.owner = owner              # the model this link serves, for its logs and errors
        self.finished = FinishedStreams()

    def key_tensor(self, name: str, key: str, rows: int = 1):
        """[rows, 1]: Triton requires every input of a batched request to have the same batch size."""
        return self.pb.Tensor(name, np.full((rows, 1), key.encode(), dtype=np.object_))

    @contextmanager
    def responses(self, inputs: list, outputs: Iterable[str]) -> Iterator[Iterator]:
        """llm_engine's responses to one BLS request; the stream is kept when the block ends."""
        stream = self.pb.InferenceRequest(model_name=self.model_name, inputs=inputs,
                                          requested_output_names=list(outputs)).exec(decoupled=True)
        try:
            yield stream
        finally:
            self.finished.keep(stream)     # after its last response (bls_retention.py)

    def cancel(self, keys: Iterable[str]) -> None:
        """One control request per key; a failed one is logged (the client's end does not wait on it)."""
        for key in keys:
            try:
                inputs = [self.pb.Tensor("input_ids", np.zeros((1, 1), dtype=np.int32)),
                          self.key_tensor("cancel_request_key", key)]
                with self.responses(inputs, ()) as stream:
                    for _ in stream:
                        pass
            except Exception:
                log.exception("%s: cancel request to llm_engine failed", self.owner)

    def close(self) -> None:
        self.finished.clear()


class Translation(Protocol):
    """A model's side of one request's stream (EngineStream.run calls it on the request's thread)."""

    def take(self, response, stream: "EngineStream") -> None:
        """One llm_engine response (data, an error, or flags only), while the final is not sent."""

    def end(self, stream: "EngineStream") -> None:
        """llm_engine's stream ended and no final was sent: send one."""

    def before_final(self) -> None:
        """Called just before the final response goes out, whoever sends it."""


class EngineStream:
    """One client request's request to llm_engine: its key, its client's sender, its end."""

    def __init__(self, link: EngineLink, call: EngineCall, sender, request_id: str):
        self.key = uuid.uuid4().hex
        self.final_sent = False
        self._link, self._call, self._sender = link, call, sender
        self._cancelled = threading.Event()
        self._cancel_lock = threading.Lock()
        self._translation: Translation | None = None
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: request %s goes to %s as key:%s", link.owner, request_id, link.model_name, self.key)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """llm_engine ends the request (any thread; once): its later responses are only drained."""
        with self._cancel_lock:
            if self._cancelled.is_set():
                return
            self._cancelled.set()
        self._link.cancel(self._call.cancel_keys(self.key))

    def send(self, response) -> None:
        self._sender.send(response)

    def send_final(self, response=None) -> None:
        """response None: the final flag alone."""
        if self._translation is not None:
            self._translation.before_final()
        self.final_sent = True
        final = self._link.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if response is None:
            self._sender.send(flags=final)
        else:
            self._sender.send(response, flags=final)

    def run(self, translation: Translation) -> None:
        """Streams the request from llm_engine through translation, to exactly one final response."""
        self._translation = translation
        link = self._link
        try:
            inputs = [link.pb.Tensor(name, array) for name, array in self._call.inputs]
            inputs.append(link.key_tensor("request_key", self.key, self._call.rows))
            with link.responses(inputs, self._call.outputs) as responses:
                for response in responses:
                    if not self.final_sent:      # else drained: llm_engine ends the request
                        translation.take(response, self)
        except Exception as exc:  # llm_engine went away, or BLS failed: the client still gets an end
            log.exception("%s stream failed", link.owner)
            if not self.final_sent:
                self.send_final(error_response(link.pb, f"{link.owner}: {exc}", "INTERNAL"))
            self.cancel()
            return
        if not self.final_sent:
            translation.end(self)
