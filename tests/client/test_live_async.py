"""asyncio client against the real server: concurrent streams, stream/non-stream agreement."""

import asyncio

import pytest

from kvshare_client import AsyncKvshareClient, GenerationRequest

pytestmark = pytest.mark.server


async def consume(client, request):
    async with client.stream(request) as s:
        deltas = [chunk.text async for chunk in s]
    return deltas, s.completion()


def test_eight_concurrent_streams(triton_server):
    topics = ["the sea", "a cat", "rain", "mountains", "coffee", "the moon", "trains", "music"]

    async def main():
        async with AsyncKvshareClient(triton_server.grpc_url, stream_timeout=300) as client:
            assert await client.is_model_ready("ensemble")
            requests = [
                GenerationRequest(
                    prompt=f"Write one sentence about {t}.",
                    apply_chat_template=True,
                    max_tokens=12,
                    temperature=0.0,
                    stream=True,
                    return_num_output_tokens=True,
                )
                for t in topics
            ]
            return await asyncio.gather(*(consume(client, r) for r in requests))

    results = asyncio.run(main())
    assert len(results) == 8
    for deltas, c in results:
        assert c.finish_reason in ("stop", "length") and not c.cancelled
        assert 1 <= c.output_tokens <= 12
        assert "".join(deltas) == c.text and c.text.strip()
        assert c.ttft_s is not None and c.ttft_s <= c.e2e_s
    # All eight were in flight together: each started before any finished.
    assert max(c.sent_at for _, c in results) < min(c.finished_at for _, c in results)


def test_streamed_deltas_join_to_the_non_streamed_text(triton_server):
    base = dict(prompt="Name three colours.", apply_chat_template=True, max_tokens=16, temperature=0.0)

    async def main():
        async with AsyncKvshareClient(triton_server.grpc_url, stream_timeout=300) as client:
            streamed = await client.generate(GenerationRequest(**base, stream=True))
            whole = await client.generate(GenerationRequest(**base, stream=False))
            return streamed, whole

    streamed, whole = asyncio.run(main())
    assert streamed.text == whole.text
    assert whole.num_responses <= 2  # one response with the text (+ possibly the empty final one)
