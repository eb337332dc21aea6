"""kvshare_client: typed gRPC streaming client for kvshare's Triton models (no torch, no kvshare).

    from kvshare_client import KvshareClient, GenerationRequest
    with KvshareClient("localhost:8001") as client:
        print(client.generate(GenerationRequest(prompt="Hi", max_tokens=16, stream=True)).text)

Load-test users live in ``kvshare_client.locust_user``; import it from a locustfile only (it
monkey-patches the process with gevent), never from here.
"""

from .aio_client import AsyncKvshareClient, AsyncResponseStream
from .errors import KvshareClientError, ProtocolError, ServerError, ServerUnavailable, StreamTimeout
from .raw_stream import RawStreamSession
from .sync_client import KvshareClient, ResponseStream
from .types import TEXT_MODEL, TOKEN_MODEL, Completion, GenerationRequest, StreamChunk

__all__ = [
    "AsyncKvshareClient",
    "AsyncResponseStream",
    "Completion",
    "GenerationRequest",
    "KvshareClient",
    "KvshareClientError",
    "ProtocolError",
    "RawStreamSession",
    "ResponseStream",
    "ServerError",
    "ServerUnavailable",
    "StreamChunk",
    "StreamTimeout",
    "TEXT_MODEL",
    "TOKEN_MODEL",
]
