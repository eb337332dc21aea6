"""vLLM's `sampling_parameters` JSON (Triton's vLLM backend contract) to kvshare's SamplingParams.

Follows vLLM's SamplingParams keys. Like vllm_backend, string values are cast by the key's type
(genai-perf and vLLM's sample client send `{"max_tokens": "100", "temperature": "0.1"}`), except that
"true"/"false" parse as booleans (vllm_backend's bool("false") is True). A key whose value is null is
unset. An unknown key, or a value kvshare cannot honour, is InvalidRequest naming
`sampling_parameters.<key>` (or `parameters.<key>` for the request-parameters fallback).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..engine.outputs import InvalidRequest
from ..sampling_params import SamplingParams
from .contract import KEY_DOCS, MAX_RETURN_SEQUENCES

_INT, _FLOAT, _BOOL, _STR = "int", "float", "bool", "str"
_TYPES = {"n": _INT, "best_of": _INT, "temperature": _FLOAT, "top_p": _FLOAT, "top_k": _INT, "min_p": _FLOAT,
          "seed": _INT, "presence_penalty": _FLOAT, "frequency_penalty": _FLOAT, "repetition_penalty": _FLOAT,
          "ignore_eos": _BOOL, "max_tokens": _INT, "min_tokens": _INT, "logprobs": _INT,
          "skip_special_tokens": _BOOL, "include_stop_str_in_output": _BOOL, "detokenize": _BOOL,
          "spaces_between_special_tokens": _BOOL, "prompt_logprobs": _INT, "use_beam_search": _BOOL,
          "truncate_prompt_tokens": _INT}
_ONLY = {"skip_special_tokens": True, "include_stop_str_in_output": False, "detokenize": True,
         "spaces_between_special_tokens": True, "use_beam_search": False}
_NULL_ONLY = ("prompt_logprobs", "allowed_token_ids", "truncate_prompt_tokens")
_REFUSED = {"structured_outputs": "structured outputs", "guided_decoding": "guided decoding", "lora_name": "LoRA"}
# vllm_model's own inputs: in the request-parameters fallback they stand for those inputs.
MODEL_INPUT_KEYS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
                    "return_logprobs", "return_num_input_tokens", "return_num_output_tokens")


@dataclass(frozen=True)
class VLLMExtras:
    """What SamplingParams alone does not carry."""
    stop_token_ids: tuple[int, ...] = ()    # end generation in addition to the model's EOS: end_ids = EOS + these
    bad_words: tuple[str, ...] = ()         # words as text, tokenized by the adapter (like GenerationRequest.bad_words)
    logprobs: int | None = None             # vLLM's logprobs (None: none asked); also in SamplingParams.logprobs
    inputs: tuple[tuple[str, bool], ...] = ()   # fallback only: vllm_model inputs given as request parameters


class ParsedSampling(NamedTuple):
    params: SamplingParams
    n: int
    extras: VLLMExtras


def _cast(field: str, kind: str, v: Any):
    """vllm_backend casts by the key's annotation; "true"/"false" are booleans here."""
    try:
        if kind == _BOOL:
            if isinstance(v, bool):
                return v
            if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0"):
                return v.strip().lower() in ("true", "1")
            if isinstance(v, (int, float)) and v in (0, 1):
                return bool(v)
            raise ValueError
        if isinstance(v, bool):
            raise ValueError
        if kind == _INT:
            f = v
            if isinstance(v, str):
                try:
                    f = int(v.strip())
                except ValueError:
                    f = float(v)
            if isinstance(f, float):
                if not f.is_integer():
                    raise ValueError
                f = int(f)
            if not isinstance(f, int):
                raise ValueError
            return f
        if kind == _FLOAT:
            if not isinstance(v, (int, float, str)):
                raise ValueError
            f = float(v)
            if not math.isfinite(f):
                raise InvalidRequest(field, f"must be a finite number, got {v!r}")
            return f
    except (TypeError, ValueError, OverflowError):
        raise InvalidRequest(field, f"must be {'a boolean' if kind == _BOOL else 'an integer' if kind == _INT else 'a number'}, "
                                    f"got {v!r}") from None
    return v


def _string_list(field: str, v: Any, *, allow_str: bool) -> tuple[str, ...]:
    if isinstance(v, str) and allow_str:
        v = [v]
    if not isinstance(v, list) or not all(isinstance(w, str) for w in v):
        raise InvalidRequest(field, f"must be {'a string or ' if allow_str else ''}a list of strings, got {v!r}")
    return tuple(w for w in v if w)


def _load(source: str | bytes | dict, prefix: str) -> dict:
    if isinstance(source, dict):
        return source
    try:
        text = source.decode("utf-8") if isinstance(source, (bytes, bytearray)) else source
        d = json.loads(text) if text.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(prefix.rstrip("."), f"is not valid JSON ({exc})") from None
    if not isinstance(d, dict):
        raise InvalidRequest(prefix.rstrip("."), f"must be a JSON object, got {type(d).__name__}")
    return d


def parse_sampling_parameters(source: str | bytes | dict, *, default_max_tokens: int,
                              prefix: str = "sampling_parameters.") -> ParsedSampling:
    """The `sampling_parameters` tensor's JSON (or an already decoded dict)."""
    return _parse(_load(source, prefix), default_max_tokens=default_max_tokens, prefix=prefix, fallback=False)


def parse_request_parameters(source: str | bytes | dict, *, default_max_tokens: int) -> ParsedSampling:
    """vllm_backend's fallback when no sampling_parameters tensor came: the request's parameters (JSON).

    Same keys as sampling_parameters, named `parameters.<key>` in errors. Also: `id` (the generate
    endpoint's request id) and `triton_*` keys (Triton's own, e.g. triton_enable_empty_final_response)
    are skipped; vllm_model's input names (stream, exclude_input_in_output, return_*) — which the
    generate endpoint turns into tensors, but a gRPC client may send as parameters — are returned as
    booleans in extras.inputs for the model to use where the tensor is absent.
    """
    return _parse(_load(source, "parameters."), default_max_tokens=default_max_tokens, prefix="parameters.",
                  fallback=True)


def _parse(d: dict, *, default_max_tokens: int, prefix: str, fallback: bool) -> ParsedSampling:
    vals: dict[str, Any] = {}
    inputs: list[tuple[str, bool]] = []
    for key, v in d.items():
        field = f"{prefix}{key}"
        if fallback and (key == "id" or key.startswith("triton_")):
            continue
        if fallback and key in MODEL_INPUT_KEYS:
            if v is not None:
                inputs.append((key, _cast(field, _BOOL, v)))
            continue
        if key in _REFUSED:
            if v is not None:
                raise InvalidRequest(field, f"kvshare does not support {_REFUSED[key]}")
            continue
        if key not in KEY_DOCS:
            raise InvalidRequest(field, "is not a sampling parameter kvshare knows (vLLM SamplingParams keys: "
                                        + ", ".join(sorted(KEY_DOCS)) + ")")
        if v is None:
            continue
        if key in _NULL_ONLY:
            raise InvalidRequest(field, f"kvshare does not support it (null only), got {v!r}")
        kind = _TYPES.get(key)
        vals[key] = _cast(field, kind, v) if kind else v
        if key in _ONLY and vals[key] != _ONLY[key]:
            raise InvalidRequest(field, f"kvshare supports only {json.dumps(_ONLY[key])}, got {v!r}")

    def bad(key: str, msg: str):
        return InvalidRequest(prefix + key, msg)

    n = vals.get("n", 1)
    if not 1 <= n <= MAX_RETURN_SEQUENCES:
        raise bad("n", f"must be in [1, {MAX_RETURN_SEQUENCES}], got {n}")
    best_of = vals.get("best_of")
    if best_of is not None and not 1 <= best_of <= n:
        raise bad("best_of", f"kvshare supports best_of <= n ({n}) only, got {best_of}")
    temperature = vals.get("temperature", 1.0)
    if temperature < 0:
        raise bad("temperature", f"must be >= 0, got {temperature}")
    top_p = vals.get("top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad("top_p", f"must be in (0, 1], got {top_p}")
    top_k = vals.get("top_k", 0)
    if top_k < -1:
        raise bad("top_k", f"must be -1 or 0 (off) or >= 1, got {top_k}")
    top_k = max(top_k, 0)
    if vals.get("min_p", 0.0) != 0.0:
        raise bad("min_p", f"kvshare does not support min_p sampling (0 only), got {vals['min_p']}")
    seed = vals.get("seed")
    if seed is not None and not 0 <= seed < 2 ** 64:
        raise bad("seed", f"must be in [0, 2**64), got {seed}")
    presence, frequency = vals.get("presence_penalty", 0.0), vals.get("frequency_penalty", 0.0)
    for key, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= v <= 2.0:
            raise bad(key, f"must be in [-2, 2], got {v}")
    repetition = vals.get("repetition_penalty", 1.0)
    if repetition <= 0:
        raise bad("repetition_penalty", f"must be > 0, got {repetition}")
    max_tokens = vals.get("max_tokens", default_max_tokens)
    if max_tokens < 1:
        raise bad("max_tokens", f"must be >= 1, got {max_tokens}")
    min_tokens = vals.get("min_tokens", 0)
    if min_tokens < 0:
        raise bad("min_tokens", f"must be >= 0, got {min_tokens}")
    logprobs = vals.get("logprobs")
    if logprobs is not None and logprobs < 0:
        raise bad("logprobs", f"must be >= 0 or null, got {logprobs}")
    stop = _string_list(prefix + "stop", vals["stop"], allow_str=True) if "stop" in vals else ()
    bad_words = _string_list(prefix + "bad_words", vals["bad_words"], allow_str=False) if "bad_words" in vals else ()
    stop_ids: tuple[int, ...] = ()
    if "stop_token_ids" in vals:
        raw = vals["stop_token_ids"]
        if not isinstance(raw, list):
            raise bad("stop_token_ids", f"must be a list of token ids, got {raw!r}")
        stop_ids = tuple(_cast(prefix + "stop_token_ids", _INT, t) for t in raw)
        if any(t < 0 for t in stop_ids):
            raise bad("stop_token_ids", f"token ids must be >= 0, got {list(stop_ids)}")
    bias: tuple[tuple[int, float], ...] = ()
    if "logit_bias" in vals:
        raw = vals["logit_bias"]
        if not isinstance(raw, dict):
            raise bad("logit_bias", f"must be an object {{token id: bias}}, got {raw!r}")
        items = []
        for tok, b in raw.items():
            try:
                tok_id = int(tok)
            except (TypeError, ValueError):
                raise bad("logit_bias", f"key {tok!r} is not a token id") from None
            if tok_id < 0:
                raise bad("logit_bias", f"token id {tok_id} must be >= 0")
            items.append((tok_id, _cast(f"{prefix}logit_bias.{tok}", _FLOAT, b)))
        bias = tuple(items)

    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_tokens=min_tokens, seed=seed,
        repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency, stop=stop,
        ignore_eos=vals.get("ignore_eos", False), logit_bias=bias, logprobs=-1 if logprobs is None else logprobs)
    return ParsedSampling(params, n, VLLMExtras(stop_token_ids=stop_ids, bad_words=bad_words, logprobs=logprobs,
                                                inputs=tuple(inputs)))
