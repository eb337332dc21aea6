"""Blocking streaming client over tritonclient.grpc (start_stream / async_stream_infer).

    with KvshareClient("localhost:8001") as client:
        with client.stream(GenerationRequest(prompt="Hi", max_tokens=32, stream=True)) as s:
            for chunk in s:
                ...                      # chunk.text is a delta
        completion = s.result()          # joined text, counts, TTFT/ITL

Each ``ResponseStream`` borrows one tritonclient client from a pool for its lifetime (a tritonclient
client can hold only one stream), so streams may run concurrently from several threads.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator, Optional

from .assembler import CompletionAssembler, check_finished_ok
from .errors import KvshareClientError, ProtocolError, from_tritonclient
from .pool import ClientPool
from .response import ChunkParser
from .types import Completion, GenerationRequest, StreamChunk, default_model_for
from .wire import WireTensor, build_tensors, new_request_id, to_infer_inputs


class ResponseStream(Iterator[StreamChunk]):
    """The responses of one request, as StreamChunks, ending after the final-flagged response.

    Iterate it, or call ``result()`` to drain it. Leaving a ``with`` block (or calling
    ``cancel()``) before the end cancels the request on the server, which then frees it.
    """

    def __init__(
        self,
        pool: ClientPool[Any],
        model: str,
        request_id: str,
        tensors: tuple[WireTensor, ...],
        stream_timeout: Optional[float],
    ) -> None:
        self.model = model
        self.request_id = request_id
        self._pool = pool
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._parser = ChunkParser()
        self._lock = threading.Lock()
        self._client: Any = pool.acquire()
        self._finished = False
        self._cancelled = False
        self._error: Optional[KvshareClientError] = None
        try:
            self._client.start_stream(callback=self._on_response, stream_timeout=stream_timeout)
            self._assembler = CompletionAssembler(model, request_id, sent_at=time.perf_counter())
            self._client.async_stream_infer(
                model,
                to_infer_inputs(tensors),
                request_id=request_id,
                enable_empty_final_response=True,
            )
        except Exception as exc:  # tritonclient raises InferenceServerException
            # When the stream died at once (server down), tritonclient only says "the stream is no
            # longer in valid state"; the real cause (e.g. UNAVAILABLE) goes to the callback.
            cause = exc
            try:
                _, _, callback_error = self._queue.get(timeout=1.0)
                cause = callback_error or exc
            except queue.Empty:
                pass
            self._release(cancel=True)
            raise from_tritonclient(cause, model=model, request_id=request_id) from exc

    # Runs on tritonclient's stream thread: stamp the arrival time there, do the rest in __next__.
    def _on_response(self, result: Any, error: Any) -> None:
        self._queue.put((time.perf_counter(), result, error))

    def __iter__(self) -> "ResponseStream":
        return self

    def __next__(self) -> StreamChunk:
        if self._finished:
            if self._error is not None:
                raise self._error
            raise StopIteration
        received_at, result, error = self._queue.get()
        if self._cancelled:  # cancel() from another thread woke us up
            raise StopIteration
        if error is not None:
            self._error = from_tritonclient(error, model=self.model, request_id=self.request_id)
            # After an error response more responses of this request may still come: cancel so
            # that the server drops it rather than finishing work nobody reads.
            self._release(cancel=True)
            raise self._error
        chunk = self._parser.parse(result, received_at)
        try:
            self._assembler.add(chunk)
        except ProtocolError as exc:
            self._error = exc
            self._release(cancel=True)
            raise
        if chunk.is_final:
            self._release(cancel=False)
        return chunk

    def cancel(self) -> None:
        """Cancel the request on the server (gRPC stream cancel) and end the iteration."""
        with self._lock:
            if self._finished:
                return
            self._cancelled = True
        self._release(cancel=True)
        # Wake a consumer blocked in __next__ on another thread.
        self._queue.put((time.perf_counter(), None, None))

    def result(self) -> Completion:
        """Drain the stream and return the Completion (raises if the server sent an error)."""
        for _ in self:
            pass
        return check_finished_ok(self.completion())

    def completion(self) -> Completion:
        """What arrived so far, frozen (finish_reason 'cancelled' if this client cancelled)."""
        return self._assembler.build(cancelled=self._cancelled)

    @property
    def done(self) -> bool:
        return self._finished

    def _release(self, *, cancel: bool) -> None:
        with self._lock:
            if self._client is None:
                return
            client, self._client = self._client, None
            self._finished = True
        try:
            # cancel_requests=False waits for the server to close the stream, which it does right
            # after the final response; True cancels the RPC so the server cancels the request.
            client.stop_stream(cancel_requests=cancel)
        finally:
            self._pool.release(client)

    def __enter__(self) -> "ResponseStream":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._finished:
            self.cancel()


class KvshareClient:
    """Thread-safe entry point; ``max_streams`` bounds the concurrent streams (pool size)."""

    def __init__(
        self,
        url: str = "localhost:8001",
        *,
        max_streams: int = 64,
        stream_timeout: Optional[float] = None,
        verbose: bool = False,
        ssl: bool = False,
    ) -> None:
        from tritonclient.grpc import InferenceServerClient

        self.url = url
        self.stream_timeout = stream_timeout

        def make() -> Any:
            return InferenceServerClient(url, verbose=verbose, ssl=ssl)

        self._pool: ClientPool[Any] = ClientPool(make, max_streams, close=lambda c: c.close())
        self._control = make()  # unary calls (health, metadata) never hold a stream slot

    def stream(
        self,
        request: GenerationRequest,
        *,
        model: Optional[str] = None,
        request_id: Optional[str] = None,
        stream_timeout: Optional[float] = None,
    ) -> ResponseStream:
        """Send ``request`` and return its response stream (blocks while all slots are busy)."""
        tensors = build_tensors(request)
        return ResponseStream(
            self._pool,
            model or default_model_for(request),
            request_id or new_request_id(),
            tensors,
            stream_timeout if stream_timeout is not None else self.stream_timeout,
        )

    def generate(self, request: GenerationRequest, **kwargs: Any) -> Completion:
        """Stream ``request`` to the end and return the Completion."""
        with self.stream(request, **kwargs) as s:
            return s.result()

    def is_server_ready(self) -> bool:
        try:
            return bool(self._control.is_server_ready())
        except Exception as exc:
            raise from_tritonclient(exc) from exc

    def is_model_ready(self, model: str) -> bool:
        try:
            return bool(self._control.is_model_ready(model))
        except Exception as exc:
            raise from_tritonclient(exc, model=model) from exc

    def close(self) -> None:
        self._pool.close()
        self._control.close()

    def __enter__(self) -> "KvshareClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
