"""One GenerationSpec as one gRPC stream to Triton's `llm_bls`, its responses as frozen deltas.

llm_bls (TensorRT-LLM's BLS contract) is the backend because it carries everything the OpenAI
endpoint needs: n forked sequences with `sequence_index`, `cache_salt`, per-token `output_log_probs`,
`cached_tokens`, and a gRPC cancel that reaches the engine (which then frees the request's pages).
Every request streams from Triton, also when the HTTP client did not ask to: the frontend assembles.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np

from .errors import ApiError, from_server_message, unavailable
from .request import GenerationSpec

BACKEND_MODEL = "llm_bls"
_OUTPUTS = ("text_output", "finish_reason", "sequence_index", "output_ids", "num_input_tokens",
            "num_output_tokens", "cached_tokens", "output_log_probs")


@dataclass(frozen=True)
class Delta:
    """One llm_bls response: new text of one sequence."""
    index: int
    text: str
    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: str | None       # None while running: "stop", "length", "cancelled", "error"
    prompt_tokens: int
    cached_tokens: int


def _tensor(name: str, arr: np.ndarray, dtype: str):
    from tritonclient.grpc import InferInput

    x = InferInput(name, list(arr.shape), dtype)
    x.set_data_from_numpy(arr)
    return x


def _scalar(name: str, value, np_dtype, dtype: str):
    return _tensor(name, np.array([[value]], dtype=np_dtype), dtype)


def _words(name: str, words) -> object:
    return _tensor(name, np.array([[w.encode("utf-8") for w in words]], dtype=np.object_), "BYTES")


def build_inputs(spec: GenerationSpec, bias_words: tuple[tuple[str, float], ...]) -> list:
    """llm_bls tensors ([1, 1] scalars: its batch dimension is 1) for the spec."""
    ins = [_words("text_input", [spec.prompt]),
           _scalar("stream", True, bool, "BOOL"),
           _scalar("exclude_input_in_output", True, bool, "BOOL"),
           _scalar("temperature", spec.temperature, np.float32, "FP32"),
           _scalar("top_p", spec.top_p, np.float32, "FP32"),
           _scalar("presence_penalty", spec.presence_penalty, np.float32, "FP32"),
           _scalar("frequency_penalty", spec.frequency_penalty, np.float32, "FP32"),
           _scalar("return_num_input_tokens", True, bool, "BOOL"),
           _scalar("return_num_output_tokens", True, bool, "BOOL")]
    if spec.max_tokens is not None:
        ins.append(_scalar("max_tokens", spec.max_tokens, np.int32, "INT32"))
    if spec.top_k > 0:
        ins.append(_scalar("top_k", spec.top_k, np.int32, "INT32"))
    if spec.min_tokens:
        ins.append(_scalar("min_tokens", spec.min_tokens, np.int32, "INT32"))
    if spec.repetition_penalty is not None:
        ins.append(_scalar("repetition_penalty", spec.repetition_penalty, np.float32, "FP32"))
    if spec.seed is not None:
        ins.append(_scalar("seed", spec.seed, np.uint64, "UINT64"))
    if spec.n > 1:
        ins.append(_scalar("num_return_sequences", spec.n, np.int32, "INT32"))
    if spec.stop:
        ins.append(_words("stop_words", spec.stop))
    if spec.logprobs:
        ins.append(_scalar("return_log_probs", True, bool, "BOOL"))
    if spec.cache_salt is not None:
        ins.append(_words("cache_salt", [spec.cache_salt]))
    if spec.ignore_eos:
        ins.append(_scalar("ignore_eos", True, bool, "BOOL"))
    if bias_words:
        ins.append(_words("embedding_bias_words", [w for w, _ in bias_words]))
        ins.append(_tensor("embedding_bias_weights", np.array([[b for _, b in bias_words]], dtype=np.float32), "FP32"))
    return ins


def _first(arr: np.ndarray | None, default=None):
    if arr is None:
        return default
    flat = np.asarray(arr).reshape(-1)
    return flat[0] if flat.size else default


def parse(result) -> Delta | None:
    """A response's tensors as a Delta; None for Triton's empty final (flags only)."""
    names = {o.name for o in result.get_response().outputs}
    if not names:
        return None

    def get(name):
        return result.as_numpy(name) if name in names else None

    text = _first(get("text_output"), b"")
    reason = _first(get("finish_reason"), b"")
    reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    ids = get("output_ids")
    lps = get("output_log_probs")
    return Delta(index=int(_first(get("sequence_index"), 0)),
                 text=text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text),
                 token_ids=() if ids is None else tuple(int(t) for t in np.asarray(ids).reshape(-1)),
                 log_probs=() if lps is None else tuple(float(x) for x in np.asarray(lps).reshape(-1)),
                 finish_reason=reason or None,
                 prompt_tokens=int(_first(get("num_input_tokens"), 0)),
                 cached_tokens=int(_first(get("cached_tokens"), 0)))


class TritonStreams:
    """The frontend's one asyncio gRPC client (create inside the running event loop)."""

    def __init__(self, url: str):
        import tritonclient.grpc.aio as aio

        self.url = url
        self._client = aio.InferenceServerClient(url)

    async def close(self) -> None:
        await self._client.close()

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_server_ready()) and bool(await self._client.is_model_ready(BACKEND_MODEL))
        except Exception:
            return False

    async def generate(self, spec: GenerationSpec, bias_words: tuple[tuple[str, float], ...] = ()
                       ) -> AsyncIterator[Delta]:
        """The spec's deltas until every sequence has finished. Leaving the iteration early (the HTTP
        client went away: the task is cancelled, or the consumer closes the generator) cancels the
        gRPC call, which Triton turns into a cancel of the request in the engine."""
        from tritonclient.grpc import InferRequestedOutput

        request = {"model_name": BACKEND_MODEL, "inputs": build_inputs(spec, bias_words),
                   "outputs": [InferRequestedOutput(n) for n in _OUTPUTS if n != "output_log_probs" or spec.logprobs],
                   "request_id": uuid.uuid4().hex,
                   "parameters": {"triton_enable_empty_final_response": True}}

        async def one_request():
            yield request

        call = self._client.stream_infer(one_request())
        finished: set[int] = set()
        try:
            while len(finished) < spec.n:
                try:
                    result, error = await call.__anext__()
                except StopAsyncIteration:
                    raise ApiError(502, "the Triton stream ended before every sequence finished",
                                   type="server_error") from None
                except asyncio.CancelledError:
                    raise
                except Exception as exc:      # grpc.aio.AioRpcError: the server is gone or refused the call
                    raise unavailable(str(getattr(exc, "details", lambda: exc)() or exc)) from None
                if error is not None:
                    raise from_server_message(error.message() if callable(getattr(error, "message", None))
                                              else str(error))
                delta = parse(result)
                if delta is None:
                    continue
                if delta.finish_reason:
                    finished.add(delta.index)
                yield delta
        finally:
            if len(finished) < spec.n:
                call.cancel()
