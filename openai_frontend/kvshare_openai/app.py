"""The FastAPI application: routes, SSE framing, error objects."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .assemble import CHAT, COMPLETION, Assembler
from .disconnect import ClientGone, until_disconnect
from .errors import ApiError, invalid, model_not_found
from .metrics import FrontendMetrics
from .request import GenerationSpec, chat_spec, completion_spec
from .tokenizer import ModelTokenizer
from .triton_stream import TritonStreams

log = logging.getLogger("kvshare.openai")


@dataclass(frozen=True)
class FrontendConfig:
    triton_url: str            # gRPC host:port of the Triton server
    model_name: str            # the id /v1/models lists and requests must name
    tokenizer_source: str      # HF folder or .gguf file of the served model


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(config: FrontendConfig, tokenizer: ModelTokenizer) -> FastAPI:
    metrics = FrontendMetrics()
    state: dict[str, TritonStreams] = {}

    @asynccontextmanager
    async def lifespan(_app):
        state["triton"] = TritonStreams(config.triton_url)   # grpc.aio binds to this loop
        yield
        await state["triton"].close()

    app = FastAPI(title="kvshare OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        metrics.request(request.url.path, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def check_model(spec: GenerationSpec) -> None:
        if spec.model != config.model_name:
            raise model_not_found(spec.model, config.model_name)

    def bias_words(spec: GenerationSpec) -> tuple[tuple[str, float], ...]:
        return tuple((tokenizer.bias_word(t), b) for t, b in spec.logit_bias)

    async def generate(kind: str, spec: GenerationSpec, request: Request):
        check_model(spec)
        words = bias_words(spec)
        asm = Assembler(kind, spec, config.model_name, tokenizer.token_text)
        deltas = until_disconnect(state["triton"].generate(spec, words), request)
        route = request.url.path
        metrics.enter()
        try:
            # the first response comes before any byte is sent, so a refusal (a bad value, an
            # overloaded engine) is an HTTP error, not an error inside a 200 stream
            first = await deltas.__anext__()
        except StopAsyncIteration:
            metrics.leave()
            raise ApiError(502, "the Triton stream ended without a response", type="server_error") from None
        except ClientGone:
            metrics.leave()
            metrics.disconnect()
            return PlainTextResponse("", status_code=499)
        except BaseException:
            metrics.leave()
            raise

        def done() -> None:
            metrics.tokens(asm.prompt_tokens, asm.completion_tokens, asm.cached_tokens)
            metrics.request(route, 200)

        if not spec.stream:
            try:
                asm.add(first)
                async for d in deltas:
                    asm.add(d)
            except ClientGone:
                metrics.disconnect()
                return PlainTextResponse("", status_code=499)
            finally:
                metrics.leave()
            done()
            return JSONResponse(asm.response())

        async def events():
            try:
                asm.add(first)
                for chunk in asm.chunks(first):
                    yield _sse(chunk)
                async for d in deltas:
                    asm.add(d)
                    for chunk in asm.chunks(d):
                        yield _sse(chunk)
                if spec.include_usage:
                    yield _sse(asm.usage_chunk())
                yield _sse("[DONE]")
                done()
            except ClientGone:
                metrics.disconnect()
            except asyncio.CancelledError:     # Starlette saw the client leave first
                metrics.disconnect()
                raise
            except ApiError as exc:       # after the 200: OpenAI's SDK raises on an error event
                metrics.request(route, exc.status)
                yield _sse(exc.body())
            finally:
                metrics.leave()
                with anyio.CancelScope(shield=True):     # Starlette cancels this task when the client leaves
                    await deltas.aclose()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(CHAT, chat_spec(await body_of(request), tokenizer.render_chat), request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(COMPLETION, completion_spec(await body_of(request)), request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvshare"}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != config.model_name:
            raise model_not_found(model_id, config.model_name)
        return {"id": config.model_name, "object": "model", "created": 0, "owned_by": "kvshare"}

    @app.get("/health")
    async def health():
        if await state["triton"].ready():
            return {"status": "ok", "triton": config.triton_url}
        return JSONResponse({"status": "unavailable", "triton": config.triton_url}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
