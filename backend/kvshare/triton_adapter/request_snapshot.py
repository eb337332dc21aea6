"""What a worker thread needs of a Triton request, read on the stub's own thread in execute().

llm_bls and vllm_model serve each request on a worker thread (a stream lasts as long as its
generation). Their inputs used to be read there, after execute() had returned. Under load a
worker once read vllm_model's one-element text_input of a valid request as an empty array, as
if the tensor's memory had gone back to the stub. Triton's own example of a decoupled model that
answers from a thread reads its inputs in execute() and hands the thread only the response sender.
So the arrays are taken there, copied out of the request's memory, and the worker never touches
the request itself again.

An input that cannot be read is not an error in execute(): it is kept and raised where the worker
asks for it, so that the worker's own error handling answers the client as before.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class _Unreadable:
    error: Exception


@dataclass(frozen=True)
class RequestSnapshot:
    """A request's response sender, input arrays (by name), parameters JSON, id, and the outputs its
    client asked for (empty: every one; a response must carry no other: response_stream.only_requested)."""
    sender: object
    arrays: Mapping[str, object]
    parameters: str
    request_id: str
    requested_outputs: frozenset[str] = frozenset()

    def get(self, name: str) -> np.ndarray | None:
        """The input's array, None when the request has no such input; raises what reading it raised."""
        value = self.arrays.get(name)
        if isinstance(value, _Unreadable):
            raise value.error
        return value


def snapshot_request(request) -> RequestSnapshot:
    """Reads everything of request on this (the stub's) thread: call it in execute()."""
    arrays: dict[str, object] = {}
    for tensor in request.inputs():
        try:
            array = tensor.as_numpy()
            # numeric arrays can be views of the request's memory; BYTES arrays are built objects
            arrays[tensor.name()] = array if array.dtype == np.object_ else array.copy()
        except Exception as exc:  # noqa: BLE001 - raised again where the worker reads it
            arrays[tensor.name()] = _Unreadable(exc)
    return RequestSnapshot(request.get_response_sender(), arrays, request.parameters(), request.request_id(),
                           frozenset(request.requested_output_names()))
