"""asyncio streaming client over tritonclient.grpc.aio (stream_infer).

    async with AsyncKvshareClient("localhost:8001") as client:
        async with client.stream(GenerationRequest(prompt="Hi", stream=True)) as s:
            async for chunk in s:
                ...
        completion = s.completion()

Unlike the sync client, one aio client multiplexes any number of concurrent streams: every
``stream_infer`` call is its own gRPC call on the shared channel.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Optional

from .assembler import CompletionAssembler, check_finished_ok
from .errors import ProtocolError, from_rpc_error, from_tritonclient
from .response import ChunkParser
from .types import Completion, GenerationRequest, StreamChunk, default_model_for
from .wire import EMPTY_FINAL_PARAM, WireTensor, build_tensors, new_request_id, to_infer_inputs


def _task_cancelling() -> bool:
    """Whether the current task itself is being cancelled (Python 3.11+; assume not before)."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())


class AsyncResponseStream(AsyncIterator[StreamChunk]):
    """The responses of one request; ``cancel()`` (or leaving ``async with`` early) cancels it."""

    def __init__(
        self,
        client: Any,
        model: str,
        request_id: str,
        tensors: tuple[WireTensor, ...],
        stream_timeout: Optional[float],
    ) -> None:
        self.model = model
        self.request_id = request_id
        self._parser = ChunkParser()
        self._finished = False
        self._cancelled = False
        inputs = to_infer_inputs(tensors)

        async def one_request() -> AsyncIterator[dict]:
            # A single request; when this generator ends the client half-closes the stream and
            # the server closes it after the request's final response.
            yield {
                "model_name": model,
                "inputs": inputs,
                "request_id": request_id,
                # stream_infer has no enable_empty_final_response argument: set the parameter.
                "parameters": {EMPTY_FINAL_PARAM: True},
            }

        self._assembler = CompletionAssembler(model, request_id, sent_at=time.perf_counter())
        try:
            self._call = client.stream_infer(one_request(), stream_timeout=stream_timeout)
        except Exception as exc:
            raise from_tritonclient(exc, model=model, request_id=request_id) from exc

    def __aiter__(self) -> "AsyncResponseStream":
        return self

    async def __anext__(self) -> StreamChunk:
        if self._finished:
            raise StopAsyncIteration
        try:
            result, error = await self._call.__anext__()
        except StopAsyncIteration:
            self._finished = True
            if self._cancelled:
                raise
            raise ProtocolError(f"stream of request {self.request_id} ended without a final response") from None
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError when the call is cancelled under a pending read: that
            # is the end of the stream if cancel() did it, not a cancellation of this task.
            if self._cancelled and not _task_cancelling():
                raise StopAsyncIteration from None
            self._abort()
            raise
        except Exception as exc:  # grpc.aio.AioRpcError (cancel, deadline, unavailable)
            self._finished = True
            if self._cancelled:
                raise StopAsyncIteration from None
            raise from_rpc_error(exc, model=self.model, request_id=self.request_id) from exc
        received_at = time.perf_counter()
        if error is not None:
            self._abort()  # the server may still hold the request: make it drop it
            raise from_tritonclient(error, model=self.model, request_id=self.request_id)
        chunk = self._parser.parse(result, received_at)
        try:
            self._assembler.add(chunk)
        except ProtocolError:
            self._abort()
            raise
        if chunk.is_final:
            self._finished = True
        return chunk

    def cancel(self) -> None:
        """Cancel the request: the server sees the gRPC cancellation and frees it.

        The completion then reports finish_reason 'cancelled'; safe to call from another task.
        """
        if not self._finished:
            self._cancelled = True
            self._abort()

    def _abort(self) -> None:
        self._finished = True
        self._call.cancel()

    async def result(self) -> Completion:
        """Drain the stream and return the Completion (raises if the server sent an error)."""
        async for _ in self:
            pass
        return check_finished_ok(self.completion())

    def completion(self) -> Completion:
        return self._assembler.build(cancelled=self._cancelled)

    @property
    def done(self) -> bool:
        return self._finished

    async def __aenter__(self) -> "AsyncResponseStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class AsyncKvshareClient:
    """Create inside a running event loop (grpc.aio channels bind to it)."""

    def __init__(
        self,
        url: str = "localhost:8001",
        *,
        stream_timeout: Optional[float] = None,
        verbose: bool = False,
        ssl: bool = False,
    ) -> None:
        from tritonclient.grpc.aio import InferenceServerClient

        self.url = url
        self.stream_timeout = stream_timeout
        self._client = InferenceServerClient(url, verbose=verbose, ssl=ssl)

    def stream(
        self,
        request: GenerationRequest,
        *,
        model: Optional[str] = None,
        request_id: Optional[str] = None,
        stream_timeout: Optional[float] = None,
    ) -> AsyncResponseStream:
        """Send ``request`` now and return its response stream."""
        return AsyncResponseStream(
            self._client,
            model or default_model_for(request),
            request_id or new_request_id(),
            build_tensors(request),
            stream_timeout if stream_timeout is not None else self.stream_timeout,
        )

    async def generate(self, request: GenerationRequest, **kwargs: Any) -> Completion:
        async with self.stream(request, **kwargs) as s:
            return await s.result()

    async def is_server_ready(self) -> bool:
        try:
            return bool(await self._client.is_server_ready())
        except Exception as exc:
            raise from_tritonclient(exc) from exc

    async def is_model_ready(self, model: str) -> bool:
        try:
            return bool(await self._client.is_model_ready(model))
        except Exception as exc:
            raise from_tritonclient(exc, model=model) from exc

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> "AsyncKvshareClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
