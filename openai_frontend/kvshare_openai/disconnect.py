"""Racing a request's generation against its HTTP client leaving.

Starlette notices a vanished client only when a send fails (ASGI spec 2.4) and never for a
non-streamed request, so generation would run to max_tokens holding KV pages. Here the ASGI receive
channel is watched for `http.disconnect` (uvicorn repeats it to every caller once the connection is
gone), and the generation's pending step is cancelled when it comes.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, TypeVar

import anyio
from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the response was complete."""


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(items: AsyncIterator[T], request: Request) -> AsyncIterator[T]:
    """items, until the client leaves: then the pending step is cancelled (the generator's cleanup
    runs, cancelling its gRPC stream) and ClientGone is raised."""
    gone = asyncio.ensure_future(_disconnected(request))
    step = None
    try:
        while True:
            step = asyncio.ensure_future(items.__anext__())
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                try:
                    await step
                except (asyncio.CancelledError, StopAsyncIteration, Exception):
                    pass
                raise ClientGone()
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        gone.cancel()
        # Starlette cancels a streaming response's task through an anyio cancel scope, which would
        # cancel these awaits too: the step must end (its gRPC call cancelled) before items closes.
        with anyio.CancelScope(shield=True):
            if step is not None and not step.done():
                step.cancel()
                with contextlib.suppress(BaseException):
                    await step
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()
