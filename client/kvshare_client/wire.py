"""GenerationRequest -> Triton input tensors, following the wire contract.

The contract (shared/design.md): both models have a batch dimension, so every scalar travels as
shape [1, 1]; ``input_ids`` and ``stop_words`` as [1, N]. Only inputs the caller set are built,
so the server's defaults apply to the rest.

The tensors are kept transport-neutral (``WireTensor``) and turned into tritonclient InferInputs
(``to_infer_inputs``) or into a hand-built protobuf request (``to_model_infer_request``, for
Locust under gevent where tritonclient's stream API hangs).
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from .types import GenerationRequest

if TYPE_CHECKING:  # tritonclient is imported lazily: pure request building needs only numpy
    from tritonclient.grpc import InferInput
    from tritonclient.grpc.service_pb2 import ModelInferRequest

# The request parameter that makes Triton send a flagged (possibly empty) final response on a
# decoupled model's stream: the only reliable "this stream is done" signal.
EMPTY_FINAL_PARAM = "triton_enable_empty_final_response"
FINAL_FLAG_PARAM = "triton_final_response"

_INT32 = (np.int32, "INT32", -(2**31), 2**31 - 1)
_UINT64 = (np.uint64, "UINT64", 0, 2**64 - 1)

# field name -> (numpy dtype, Triton datatype) for the optional scalar inputs, in wire order.
_INT_FIELDS: dict[str, tuple] = {"max_tokens": _INT32, "top_k": _INT32, "min_tokens": _INT32, "seed": _UINT64}
_FLOAT_FIELDS = ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOL_FIELDS = (
    "stream",
    "exclude_input_in_output",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "apply_chat_template",
    "ignore_eos",
)


@dataclass(frozen=True, eq=False)
class WireTensor:
    """One named input tensor, batch dimension included."""

    name: str
    datatype: str  # Triton datatype: BYTES, INT32, UINT64, FP32, BOOL
    array: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.array.shape)

    def raw_bytes(self) -> bytes:
        """Serialisation for ModelInferRequest.raw_input_contents (what tritonclient sends)."""
        if self.datatype == "BYTES":
            # Each element: 4-byte little-endian length, then the bytes (row-major order).
            return b"".join(struct.pack("<I", len(b)) + b for b in self.array.reshape(-1))
        return np.ascontiguousarray(self.array).astype(self.array.dtype.newbyteorder("<"), copy=False).tobytes()


def _bytes_tensor(name: str, values: tuple[str, ...]) -> WireTensor:
    arr = np.array([[v.encode("utf-8") for v in values]], dtype=np.object_)
    return WireTensor(name, "BYTES", arr.reshape(1, len(values)))


def _int_tensor(name: str, value: Any, spec: tuple) -> WireTensor:
    dtype, datatype, lo, hi = spec
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}")
    value = value.__index__()
    # numpy 1.x wraps out-of-range Python ints silently: a max_tokens of 2**32 would become 0.
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} does not fit {datatype}")
    return WireTensor(name, datatype, np.array([[value]], dtype=dtype))


def _float_tensor(name: str, value: Any) -> WireTensor:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    return WireTensor(name, "FP32", np.array([[value]], dtype=np.float32))


def _bool_tensor(name: str, value: Any) -> WireTensor:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return WireTensor(name, "BOOL", np.array([[bool(value)]], dtype=np.bool_))


def build_tensors(request: GenerationRequest) -> tuple[WireTensor, ...]:
    """The input tensors for ``request``: the prompt plus every optional input that is set."""
    if request.prompt is not None:
        out = [_bytes_tensor("text_input", (request.prompt,))]
    else:
        ids = request.input_ids or ()
        for i in ids:
            if not _INT32[2] <= i <= _INT32[3]:
                raise ValueError(f"input_ids: {i} does not fit INT32")
        out = [WireTensor("input_ids", "INT32", np.array([list(ids)], dtype=np.int32).reshape(1, len(ids)))]

    for name, spec in _INT_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            out.append(_int_tensor(name, value, spec))
    for name in _FLOAT_FIELDS:
        value = getattr(request, name)
        if value is not None:
            out.append(_float_tensor(name, value))
    for name in _BOOL_FIELDS:
        value = getattr(request, name)
        if value is not None:
            out.append(_bool_tensor(name, value))
    if request.cache_salt is not None:
        out.append(_bytes_tensor("cache_salt", (request.cache_salt,)))
    # An empty stop-word list means "no stop words": sending a [1, 0] tensor would only invite a
    # shape error, and leaving it out means the same thing.
    if request.stop_words:
        out.append(_bytes_tensor("stop_words", tuple(request.stop_words)))
    return tuple(out)


def new_request_id() -> str:
    """Short unique id: Triton echoes it on responses and logs it with errors."""
    return uuid.uuid4().hex[:16]


def to_infer_inputs(tensors: tuple[WireTensor, ...]) -> list["InferInput"]:
    """tritonclient InferInputs (shared by tritonclient.grpc and tritonclient.grpc.aio)."""
    from tritonclient.grpc import InferInput

    inputs = []
    for t in tensors:
        inp = InferInput(t.name, list(t.shape), t.datatype)
        inp.set_data_from_numpy(t.array)
        inputs.append(inp)
    return inputs


def to_model_infer_request(
    model: str,
    tensors: tuple[WireTensor, ...],
    *,
    request_id: str = "",
    model_version: str = "",
    parameters: Optional[dict[str, Any]] = None,
) -> "ModelInferRequest":
    """A hand-built protobuf request for the raw GRPCInferenceServiceStub (no tritonclient stream)."""
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=model, model_version=model_version, id=request_id)
    for t in tensors:
        tensor = req.inputs.add()
        tensor.name = t.name
        tensor.datatype = t.datatype
        tensor.shape.extend(t.shape)
        req.raw_input_contents.append(t.raw_bytes())
    req.parameters[EMPTY_FINAL_PARAM].bool_param = True
    for key, value in (parameters or {}).items():
        param = req.parameters[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = str(value)
    return req
