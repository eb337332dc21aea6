"""One streamed OpenAI completion over plain HTTP/1.1 (asyncio streams, no HTTP library needed).

    result = await stream_completion("http://127.0.0.1:8000", {"model": "m", "prompt": "Hi",
                                     "max_tokens": 16, "stream": True}, timeout_s=60)

`POST /v1/completions` with `stream: true` answers Server-Sent Events (`data: {json}` blocks, then
`data: [DONE]`), usually in chunked transfer encoding. Every event that carries text or token ids
is timed on arrival (time.perf_counter). Tokens per event: the event's `token_ids` (vLLM's
`return_token_ids`), else 1 for an event with text; the total: the final `usage.completion_tokens`
when the server sends it (`stream_options.include_usage`), else the sum.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional
from urllib.parse import urlsplit


class HttpError(RuntimeError):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


@dataclass(frozen=True)
class StreamedCompletion:
    sent_at: float
    finished_at: float
    text: str
    output_tokens: int
    finish_reason: Optional[str]
    content_times: tuple[float, ...] = field(default=())
    content_tokens: tuple[int, ...] = field(default=())


def _address(base_url: str) -> tuple[str, int, str]:
    u = urlsplit(base_url if "//" in base_url else f"http://{base_url}")
    if u.scheme != "http":
        raise ValueError(f"url: only http:// is spoken here, got {base_url!r}")
    return u.hostname or "127.0.0.1", u.port or 80, u.path.rstrip("/")


async def _body_bytes(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)          # the chunk's CRLF


def parse_events(buffer: str) -> tuple[list[str], str]:
    """Complete SSE events' `data` payloads in buffer, and the incomplete rest."""
    buffer = buffer.replace("\r\n", "\n")
    *events, rest = buffer.split("\n\n")
    out = []
    for event in events:
        data = [line[5:].lstrip() for line in event.split("\n") if line.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out, rest


async def stream_completion(base_url: str, body: dict, *, timeout_s: float,
                            path: str = "/v1/completions") -> StreamedCompletion:
    host, port, prefix = _address(base_url)
    payload = json.dumps(body).encode()
    head = (f"POST {prefix}{path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()

    async def run() -> StreamedCompletion:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            sent = time.perf_counter()
            writer.write(head + payload)
            await writer.drain()
            status_line = (await reader.readline()).decode("latin-1")
            parts = status_line.split(" ", 2)
            if len(parts) < 2 or not parts[1].isdigit():
                raise HttpError(0, f"not an HTTP response: {status_line!r}")
            status = int(parts[1])
            headers = {}
            while (line := (await reader.readline()).decode("latin-1").strip()):
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            if status != 200:
                raw = b"".join([b async for b in _body_bytes(reader, chunked)])
                raise HttpError(status, raw.decode("utf-8", "replace"))
            times, counts, texts = [], [], []
            usage_tokens: Optional[int] = None
            finish: Optional[str] = None
            rest, done = "", False
            async for data in _body_bytes(reader, chunked):
                events, rest = parse_events(rest + data.decode("utf-8"))
                now = time.perf_counter()
                for e in events:
                    if e == "[DONE]":
                        done = True
                        break
                    msg = json.loads(e)
                    if "error" in msg and not msg.get("choices"):
                        raise HttpError(status, json.dumps(msg["error"]))
                    if msg.get("usage") and msg["usage"].get("completion_tokens") is not None:
                        usage_tokens = int(msg["usage"]["completion_tokens"])
                    for choice in msg.get("choices") or []:
                        text = choice.get("text") or ""
                        n = len(choice["token_ids"]) if choice.get("token_ids") is not None else (1 if text else 0)
                        if n:
                            times.append(now)
                            counts.append(n)
                            texts.append(text)
                        finish = choice.get("finish_reason") or finish
                if done:
                    break
            if not done:
                raise HttpError(status, "the stream ended without data: [DONE]")
            return StreamedCompletion(sent, time.perf_counter(), "".join(texts),
                                      usage_tokens if usage_tokens is not None else sum(counts), finish,
                                      tuple(times), tuple(counts))
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    return await asyncio.wait_for(run(), timeout_s)
