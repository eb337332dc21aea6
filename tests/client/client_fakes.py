"""Test doubles shaped like Triton's protobuf responses and tritonclient's stream client."""

from __future__ import annotations

import struct
import threading
from typing import Any, Optional, Sequence

import numpy as np
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import InferenceServerException

from kvshare_client.wire import FINAL_FLAG_PARAM


def bytes_raw(values: Sequence[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def make_response(
    *,
    text: Optional[bytes] = None,
    ids: Optional[Sequence[int]] = None,
    finish_reason: Optional[str] = None,
    num_input_tokens: Optional[int] = None,
    num_output_tokens: Optional[int] = None,
    cached_tokens: Optional[int] = None,
    final: bool = False,
    request_id: str = "r1",
) -> service_pb2.ModelInferResponse:
    """A ModelInferResponse as the server sends it (raw_output_contents, batch dim 1)."""
    resp = service_pb2.ModelInferResponse(model_name="m", id=request_id)

    def add(name: str, datatype: str, shape: list[int], raw: bytes) -> None:
        out = resp.outputs.add()
        out.name, out.datatype = name, datatype
        out.shape.extend(shape)
        resp.raw_output_contents.append(raw)

    if text is not None:
        add("text_output", "BYTES", [1, 1], bytes_raw([text]))
    if ids is not None:
        add("output_ids", "INT32", [1, len(ids)], np.array(ids, dtype=np.int32).tobytes())
    if finish_reason is not None:
        add("finish_reason", "BYTES", [1, 1], bytes_raw([finish_reason.encode()]))
    for name, value in (
        ("num_input_tokens", num_input_tokens),
        ("num_output_tokens", num_output_tokens),
        ("cached_tokens", cached_tokens),
    ):
        if value is not None:
            add(name, "INT32", [1, 1], np.array([value], dtype=np.int32).tobytes())
    if final:
        resp.parameters[FINAL_FLAG_PARAM].bool_param = True
    return resp


def result(**kwargs: Any) -> InferResult:
    return InferResult(make_response(**kwargs))


class FakeStreamClient:
    """Stands in for tritonclient.grpc.InferenceServerClient's stream API.

    ``script`` is what the "server" answers to each request: a list of InferResults and
    InferenceServerExceptions, delivered from another thread like tritonclient's handler does.
    ``hang=True`` delivers the script and then keeps the stream open until stop_stream.
    """

    instances: list["FakeStreamClient"] = []

    def __init__(self, script: Sequence[Any] = (), hang: bool = False) -> None:
        self.script = list(script)
        self.hang = hang
        self.callback: Any = None
        self.sent: list[dict[str, Any]] = []
        self.stopped: list[bool] = []  # cancel_requests flag of each stop_stream
        self.closed = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        FakeStreamClient.instances.append(self)

    def start_stream(self, callback: Any, stream_timeout: Any = None) -> None:
        assert self.callback is None, "one active stream per client"
        self.callback = callback
        self._stop.clear()

    def async_stream_infer(
        self, model_name: str, inputs: Any, request_id: str = "", enable_empty_final_response: bool = False, **kw: Any
    ) -> None:
        assert self.callback is not None
        self.sent.append(
            {
                "model": model_name,
                "inputs": inputs,
                "request_id": request_id,
                "enable_empty_final_response": enable_empty_final_response,
            }
        )

        def deliver() -> None:
            for item in self.script:
                if self._stop.is_set():
                    return
                if isinstance(item, InferenceServerException):
                    self.callback(result=None, error=item)
                else:
                    self.callback(result=item, error=None)
            if self.hang:
                self._stop.wait(10)

        self._thread = threading.Thread(target=deliver, daemon=True)
        self._thread.start()

    def stop_stream(self, cancel_requests: bool = False) -> None:
        self.stopped.append(cancel_requests)
        self._stop.set()
        if cancel_requests and self.callback is not None:
            self.callback(
                result=None,
                error=InferenceServerException("Locally cancelled by application!", status="StatusCode.CANCELLED"),
            )
        if self._thread is not None:
            self._thread.join(5)
        self.callback = None

    def close(self) -> None:
        self.closed = True
