"""Sync and asyncio stream mechanics against fake transports (no server)."""

import asyncio
import threading
import time

import pytest
from tritonclient.utils import InferenceServerException

from client_fakes import FakeStreamClient, result
from kvshare_client.aio_client import AsyncResponseStream
from kvshare_client.errors import ServerError, ServerUnavailable
from kvshare_client.pool import ClientPool
from kvshare_client.sync_client import ResponseStream
from kvshare_client.types import GenerationRequest
from kvshare_client.wire import EMPTY_FINAL_PARAM, build_tensors

TENSORS = build_tensors(GenerationRequest(prompt="hi", max_tokens=3, stream=True))


def pool_of(*clients):
    it = iter(clients)
    return ClientPool(lambda: next(it), max_size=len(clients), close=lambda c: c.close())


def test_stream_yields_chunks_until_final_and_returns_the_client():
    fake = FakeStreamClient(
        [
            result(text=b"Par", num_output_tokens=1),
            result(text=b"is", num_output_tokens=1),
            result(finish_reason="stop", final=True),
        ]
    )
    pool = pool_of(fake)
    s = ResponseStream(pool, "ensemble", "r1", TENSORS, None)
    chunks = list(s)
    assert [c.text for c in chunks] == ["Par", "is", ""] and chunks[-1].is_final
    c = s.result()
    assert (c.text, c.finish_reason, c.output_tokens, c.cancelled) == ("Paris", "stop", 2, False)
    sent = fake.sent[0]
    assert sent["enable_empty_final_response"] and sent["model"] == "ensemble" and sent["request_id"] == "r1"
    assert [i.name() for i in sent["inputs"]] == ["text_input", "max_tokens", "stream"]
    assert fake.stopped == [False]  # graceful close after the final response
    assert pool.acquire(timeout=0) is fake  # back in the pool, reusable


def test_server_error_response_raises_and_cancels_the_request():
    fake = FakeStreamClient([result(text=b"a"), InferenceServerException("top_p must be in (0, 1], got 2.0")])
    s = ResponseStream(pool_of(fake), "ensemble", "r1", TENSORS, None)
    assert next(s).text == "a"
    with pytest.raises(ServerError, match=r"top_p must be in \(0, 1\]"):
        next(s)
    assert fake.stopped == [True]
    with pytest.raises(ServerError):  # the error sticks
        next(s)


def test_unavailable_maps_to_server_unavailable():
    fake = FakeStreamClient([InferenceServerException("failed to connect", status="StatusCode.UNAVAILABLE")])
    with pytest.raises(ServerUnavailable):
        list(ResponseStream(pool_of(fake), "ensemble", "r1", TENSORS, None))


def test_leaving_the_with_block_early_cancels_on_the_server():
    fake = FakeStreamClient([result(text=b"a"), result(text=b"b")], hang=True)
    with ResponseStream(pool_of(fake), "ensemble", "r1", TENSORS, None) as s:
        next(s)
    assert fake.stopped == [True]
    c = s.completion()
    assert c.cancelled and c.finish_reason == "cancelled" and c.text == "a"
    assert list(s) == []  # iteration is over, no error


def test_cancel_from_another_thread_unblocks_the_consumer():
    fake = FakeStreamClient([result(text=b"a")], hang=True)
    s = ResponseStream(pool_of(fake), "ensemble", "r1", TENSORS, None)
    seen = []
    t = threading.Thread(target=lambda: seen.extend(c.text for c in s))
    t.start()
    while not seen:
        time.sleep(0.001)
    s.cancel()
    t.join(5)
    assert not t.is_alive() and seen == ["a"] and s.completion().cancelled


def test_pool_bounds_concurrent_streams():
    made = []
    pool = ClientPool(lambda: made.append(object()) or made[-1], max_size=2, close=lambda c: None)
    a, b = pool.acquire(), pool.acquire()
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.05)
    pool.release(a)
    assert pool.acquire(timeout=0) is a and pool.size == 2
    pool.release(a)
    pool.release(b)
    pool.close()
    with pytest.raises(RuntimeError):
        pool.acquire(timeout=0)


class FakeAioCall:
    """What tritonclient.grpc.aio's stream_infer returns: async (result, error) pairs + cancel().

    Like grpc.aio, cancelling the call makes a pending read raise asyncio.CancelledError.
    """

    def __init__(self, items, requests, hang=False):
        self.items, self.requests, self.hang, self.cancelled = list(items), requests, hang, False
        self.sent = []
        self._cancel = asyncio.Event()

    async def __anext__(self):
        if not self.sent:
            self.sent = [r async for r in self.requests]
        if self.cancelled:
            raise asyncio.CancelledError
        if self.items:
            item = self.items.pop(0)
            return (None, item) if isinstance(item, InferenceServerException) else (item, None)
        if self.hang:
            await self._cancel.wait()
            raise asyncio.CancelledError
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True
        self._cancel.set()
        return True


class FakeAioClient:
    def __init__(self, items, hang=False):
        self.items, self.hang, self.call = items, hang, None

    def stream_infer(self, inputs_iterator, stream_timeout=None):
        self.call = FakeAioCall(self.items, inputs_iterator, self.hang)
        return self.call


def test_aio_stream_assembles_and_sends_the_empty_final_parameter():
    async def run():
        client = FakeAioClient([result(text=b"4", num_output_tokens=1), result(final=True, finish_reason="length")])
        s = AsyncResponseStream(client, "ensemble", "r9", TENSORS, None)
        c = await s.result()
        request = client.call.sent[0]
        return c, request

    c, request = asyncio.run(run())
    assert (c.text, c.finish_reason, c.output_tokens) == ("4", "length", 1)
    assert request["parameters"] == {EMPTY_FINAL_PARAM: True} and request["request_id"] == "r9"


def test_aio_error_and_cancel():
    async def run():
        client = FakeAioClient([result(text=b"a"), InferenceServerException("prompt longer than the context")])
        s = AsyncResponseStream(client, "ensemble", "r", TENSORS, None)
        assert (await s.__anext__()).text == "a"
        with pytest.raises(ServerError, match="longer than the context"):
            await s.__anext__()
        assert client.call.cancelled  # the server is told to drop the request
        assert not s.completion().cancelled  # ... but it was an error, not a client cancel

        client2 = FakeAioClient([result(text=b"a")], hang=True)
        async with AsyncResponseStream(client2, "ensemble", "r", TENSORS, None) as s2:
            async for _ in s2:
                break
        assert client2.call.cancelled and s2.completion().finish_reason == "cancelled"

    asyncio.run(run())


def test_aio_cancel_from_another_task_ends_a_pending_read():
    async def run():
        client = FakeAioClient([result(text=b"a")], hang=True)
        s = AsyncResponseStream(client, "llm_engine", "r", TENSORS, None)

        async def consume():
            return [c.text async for c in s]

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)  # the consumer now waits for a response that never comes
        s.cancel()
        return await asyncio.wait_for(task, 5), s.completion()

    texts, c = asyncio.run(run())
    assert texts == ["a"] and c.cancelled and c.finish_reason == "cancelled"


def test_aio_task_cancellation_cancels_the_call_and_propagates():
    async def run():
        client = FakeAioClient([], hang=True)

        async def consume():
            async with AsyncResponseStream(client, "llm_engine", "r", TENSORS, None) as s:
                async for _ in s:
                    pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return client.call.cancelled

    assert asyncio.run(run())
