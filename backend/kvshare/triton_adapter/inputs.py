"""The wire contract's inputs, parsed and validated (no Triton imports: tested without a server).

Every error names the offending input, as clients and the contract in docs expect.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..engine.outputs import InvalidRequest
from ..sampling_params import SamplingParams

Getter = Callable[[str], "np.ndarray | None"]


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt of a Triton request (a [B, ...] request is B of these, batch_index 0..B-1)."""
    prompt_ids: list[int]
    params: SamplingParams            # bad_words / logit_bias as token ids are filled in by the adapter
    stream: bool
    exclude_input_in_output: bool
    return_num_input_tokens: bool
    return_num_output_tokens: bool
    cache_salt: str
    num_return_sequences: int = 1     # n > 1: n sequences forked from one prefill (sequence_index)
    batch_index: int = 0
    batch_size: int = 1
    return_log_probs: bool = False    # cum_log_probs, output_log_probs
    return_perf_metrics: bool = False  # kv_cache_*_blocks, *_time_ns (and the speculative ones as 0)
    return_context_logits: bool = False
    return_generation_logits: bool = False
    bad_words: tuple[str, ...] = ()   # words as text (empty strings dropped): tokenized by the adapter
    embedding_bias: tuple[tuple[str, float], ...] = ()   # (word, weight): every token of the word gets weight
    pad_id: int | None = None         # pads beams of unequal length in output_ids


def _scalar(get: Getter, name: str):
    arr = get(name)
    if arr is None:
        return None
    if arr.size != 1:
        raise InvalidRequest(name, f"expected one value (shape [1] or [1,1]), got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _bool(get: Getter, name: str, default: bool) -> bool:
    v = _scalar(get, name)
    return default if v is None else bool(v)


def _int(get: Getter, name: str, default: int | None, lo: int | None = None) -> int | None:
    v = _scalar(get, name)
    if v is None:
        return default
    v = int(v)
    if lo is not None and v < lo:
        raise InvalidRequest(name, f"must be >= {lo}, got {v}")
    return v


def _float(get: Getter, name: str, default: float) -> float:
    v = _scalar(get, name)
    if v is None:
        return default
    v = float(v)
    if not math.isfinite(v):
        raise InvalidRequest(name, f"must be a finite number, got {v}")
    return v


def decode_utf8(raw: bytes | str, name: str) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(name, f"is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def text_input(get: Getter, name: str = "text_input") -> str:
    v = _scalar(get, name)
    if v is None:
        raise InvalidRequest(name, "is required")
    text = decode_utf8(v, name)
    if not text.strip():
        raise InvalidRequest(name, "is empty")
    return text


def stop_words(get: Getter) -> tuple[str, ...]:
    arr = get("stop_words")
    if arr is None:
        return ()
    if arr.dtype != np.object_ and arr.dtype.kind not in ("S", "U"):
        raise InvalidRequest("stop_words", f"must be STRING (BYTES), got {arr.dtype}")
    if arr.ndim > 2 or (arr.ndim == 2 and arr.shape[0] != 1):
        raise InvalidRequest("stop_words", f"expected a list of strings, shape [N] or [1,N]; got {list(arr.shape)}")
    words = tuple(decode_utf8(w, "stop_words") for w in arr.reshape(-1))
    if any(not w for w in words):
        raise InvalidRequest("stop_words", "contains an empty string")
    return words


def sampling_params(get: Getter, *, default_max_tokens: int) -> SamplingParams:
    max_tokens = _int(get, "max_tokens", default_max_tokens)
    if max_tokens <= 0:
        raise InvalidRequest("max_tokens", f"must be > 0, got {max_tokens}")
    temperature = _float(get, "temperature", 1.0)
    if temperature < 0:
        raise InvalidRequest("temperature", f"must be >= 0, got {temperature}")
    top_p = _float(get, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest("top_p", f"must be in (0, 1], got {top_p}")
    repetition = _float(get, "repetition_penalty", 1.0)
    if repetition <= 0:
        raise InvalidRequest("repetition_penalty", f"must be > 0, got {repetition}")
    presence = _float(get, "presence_penalty", 0.0)
    frequency = _float(get, "frequency_penalty", 0.0)
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= v <= 2.0:
            raise InvalidRequest(name, f"must be in [-2, 2], got {v}")
    seed = _scalar(get, "seed")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=_int(get, "top_k", 0, lo=0),
        min_tokens=_int(get, "min_tokens", 0, lo=0),
        seed=None if seed is None else int(seed),
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
        stop=stop_words(get),
        ignore_eos=_bool(get, "ignore_eos", False),
    )


def prompt_ids(get: Getter) -> list[int]:
    arr = get("input_ids")
    if arr is None:
        raise InvalidRequest("input_ids", "is required")
    if arr.ndim == 2 and arr.shape[0] != 1:
        raise InvalidRequest("input_ids", f"batch size must be 1 (one request per prompt), got {arr.shape[0]}")
    if arr.ndim > 2:
        raise InvalidRequest("input_ids", f"expected shape [1, N], got {list(arr.shape)}")
    ids = arr.reshape(-1).astype(np.int64).tolist()
    if not ids:
        raise InvalidRequest("input_ids", "is empty")
    return ids


def generation_request(get: Getter, *, default_max_tokens: int) -> GenerationRequest:
    salt = _scalar(get, "cache_salt")
    return GenerationRequest(
        prompt_ids=prompt_ids(get),
        params=sampling_params(get, default_max_tokens=default_max_tokens),
        stream=_bool(get, "stream", False),
        exclude_input_in_output=_bool(get, "exclude_input_in_output", True),
        return_num_input_tokens=_bool(get, "return_num_input_tokens", False),
        return_num_output_tokens=_bool(get, "return_num_output_tokens", False),
        cache_salt="" if salt is None else decode_utf8(salt, "cache_salt"),
    )
