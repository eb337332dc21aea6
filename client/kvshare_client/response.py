"""One Triton response -> StreamChunk.

Works on anything shaped like tritonclient's ``InferResult`` (``as_numpy(name)`` and
``get_response()`` returning the ModelInferResponse protobuf), which is what the sync client, the
aio client and the raw stub (wrapped in ``InferResult``) all produce.

The parser is per stream because of UTF-8: the contract promises that each text delta is whole
UTF-8, but an incremental decoder costs nothing and keeps a server that splits a multi-byte
character across two responses from showing U+FFFD to the user.
"""

from __future__ import annotations

import codecs
import time
from typing import Any, Callable, Optional, Protocol

import numpy as np

from .types import StreamChunk
from .wire import FINAL_FLAG_PARAM


class ResultLike(Protocol):
    def as_numpy(self, name: str) -> Optional[np.ndarray]: ...

    def get_response(self) -> Any: ...


def is_final(result: ResultLike) -> bool:
    """The ``triton_final_response`` flag Triton adds when the request asked for it."""
    params = result.get_response().parameters
    return FINAL_FLAG_PARAM in params and bool(params[FINAL_FLAG_PARAM].bool_param)


def _first_int(arr: Optional[np.ndarray]) -> Optional[int]:
    if arr is None or arr.size == 0:
        return None
    return int(arr.reshape(-1)[0])


def _joined_bytes(arr: Optional[np.ndarray]) -> bytes:
    # BYTES tensors come back as object arrays of bytes; [1,1] normally, but join all elements so
    # a server that returns several pieces in one response loses nothing.
    if arr is None or arr.size == 0:
        return b""
    return b"".join(v if isinstance(v, bytes) else str(v).encode("utf-8") for v in arr.reshape(-1))


class ChunkParser:
    """Stateful decoder of one stream's responses, in arrival order."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._clock = clock
        self._index = 0

    def parse(self, result: ResultLike, received_at: Optional[float] = None) -> StreamChunk:
        final = is_final(result)
        text = self._decoder.decode(_joined_bytes(result.as_numpy("text_output")), final=final)
        ids = result.as_numpy("output_ids")
        reason = _joined_bytes(result.as_numpy("finish_reason")).decode("utf-8", errors="replace")
        chunk = StreamChunk(
            index=self._index,
            text=text,
            token_ids=tuple(int(i) for i in ids.reshape(-1)) if ids is not None else (),
            finish_reason=reason or None,
            num_input_tokens=_first_int(result.as_numpy("num_input_tokens")),
            num_output_tokens=_first_int(result.as_numpy("num_output_tokens")),
            cached_tokens=_first_int(result.as_numpy("cached_tokens")),
            is_final=final,
            received_at=self._clock() if received_at is None else received_at,
        )
        self._index += 1
        return chunk
