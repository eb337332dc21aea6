"""One long-lived ModelStreamInfer call on the raw gRPC stub, for one request at a time.

Why not tritonclient's stream API: under Locust (gevent) ``start_stream`` + ``async_stream_infer``
hangs the whole process, even after ``grpc.experimental.gevent.init_gevent()``
(shared/environment.md). The generated stub with hand-built ``ModelInferRequest``s works; this
module wraps it. It needs no gevent itself and runs just as well on plain threads.

The call stays open between requests (one gRPC stream per owner, like a tritonclient client); any
error closes it and the next request opens a new one, so a broken stream never poisons the next.
Because the call outlives its requests, ``stream_timeout`` is each request's own deadline, enforced
by cancelling the call, and never a gRPC deadline on the call: that one counted from the stream's
opening, so a request on a stream that had served others for that long failed as "deadline
exceeded" after seconds (the soak's rare "hung" streams).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator, Optional

from .assembler import CompletionAssembler, check_finished_ok
from .errors import KvshareClientError, ProtocolError, ServerError, StreamTimeout, from_rpc_error
from .response import ChunkParser
from .types import Completion, StreamChunk
from .wire import WireTensor, new_request_id, to_model_infer_request

# Generated text and long prompts can exceed gRPC's 4 MiB default message limit.
_CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
)


class RawStreamSession:
    """Owns a channel and (lazily) one bidirectional stream; not for concurrent use."""

    def __init__(self, url: str, *, stream_timeout: Optional[float] = None) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.url = url
        self._stream_timeout = stream_timeout
        self._channel = grpc.insecure_channel(url, options=_CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._requests: Optional[queue.Queue] = None
        self._call: Any = None
        self._responses: Optional[Iterator[Any]] = None

    def _open(self) -> None:
        requests: queue.Queue = queue.Queue()

        def feed() -> Iterator[Any]:
            # grpc pulls this from its own (green)thread; None half-closes the stream.
            while (req := requests.get()) is not None:
                yield req

        self._requests = requests
        self._call = self._stub.ModelStreamInfer(feed())
        self._responses = iter(self._call)

    def _drop(self) -> None:
        """Abandon the current stream; cancelling it makes the server cancel what it still runs."""
        call, self._call, self._responses = self._call, None, None
        if self._requests is not None:
            self._requests.put(None)
            self._requests = None
        if call is not None:
            call.cancel()

    def generate(
        self,
        model: str,
        tensors: tuple[WireTensor, ...],
        *,
        request_id: Optional[str] = None,
        on_chunk: Optional[Callable[[StreamChunk], None]] = None,
    ) -> Completion:
        """Send one request and read its responses until the final flag; return the Completion.
        Raises StreamTimeout when the final response has not come within ``stream_timeout`` s."""
        request_id = request_id or new_request_id()
        if self._call is None:
            self._open()
        assert self._requests is not None and self._responses is not None
        parser = ChunkParser()
        assembler = CompletionAssembler(model, request_id, sent_at=time.perf_counter())
        deadline = self._arm_deadline(self._call)
        self._requests.put(to_model_infer_request(model, tensors, request_id=request_id))
        try:
            from tritonclient.grpc import InferResult

            for response in self._responses:
                received_at = time.perf_counter()
                if response.error_message:
                    raise ServerError(response.error_message, model=model, request_id=request_id)
                # One request at a time on this stream: a response of another request (one that came
                # after an earlier request's final response) breaks "exactly one final response".
                answered = response.infer_response.id
                if answered and answered != request_id:
                    raise ProtocolError(f"a response of request {answered} arrived while {request_id} was open")
                chunk = parser.parse(InferResult(response.infer_response), received_at)
                assembler.add(chunk)
                if on_chunk is not None:
                    on_chunk(chunk)
                if chunk.is_final:
                    return check_finished_ok(assembler.build())
            raise ProtocolError(f"the server closed the stream before the final response of {request_id}")
        except KvshareClientError:
            self._drop()
            raise
        except Exception as exc:  # grpc.RpcError: unavailable, deadline, cancelled
            self._drop()
            if deadline is not None and deadline.expired.is_set():
                raise StreamTimeout(f"stream deadline exceeded: no final response of {request_id} within "
                                    f"{self._stream_timeout:g} s") from exc
            if callable(getattr(exc, "code", None)):
                raise from_rpc_error(exc, model=model, request_id=request_id) from exc
            raise
        except BaseException:
            # gevent.Timeout / GreenletExit / KeyboardInterrupt mid-stream: responses of this request
            # may still be in flight, so the stream cannot be reused.
            self._drop()
            raise
        finally:
            if deadline is not None:
                deadline.cancel()

    def _arm_deadline(self, call: Any) -> Optional["_Deadline"]:
        if self._stream_timeout is None:
            return None
        deadline = _Deadline(self._stream_timeout, call.cancel)
        deadline.start()
        return deadline

    def close(self) -> None:
        self._drop()
        self._channel.close()

    def __enter__(self) -> "RawStreamSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Deadline(threading.Timer):
    """Cancels the call when a request outlives its timeout (a greenlet under gevent's patching)."""

    def __init__(self, seconds: float, cancel: Callable[[], Any]) -> None:
        self.expired = threading.Event()

        def expire() -> None:
            self.expired.set()
            cancel()

        super().__init__(seconds, expire)
        self.daemon = True
