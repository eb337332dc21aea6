"""OpenAI request bodies to one frozen GenerationSpec, refusing by name what kvshare cannot honour.

Every body field is either read, accepted only at its neutral value, or refused with a 400 naming it
(OpenAI's own behaviour for unknown fields): nothing is silently ignored. Besides OpenAI's fields the
vLLM-style extras `ignore_eos`, `cache_salt`, `top_k`, `min_tokens`, `repetition_penalty` are read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from .errors import invalid, unsupported

MAX_N = 8          # llm_bls forks at most 8 sequences from one prefill
MAX_STOP = 4       # OpenAI's limit


@dataclass(frozen=True)
class GenerationSpec:
    """One generation request as llm_bls takes it (prompt already rendered)."""
    model: str
    prompt: str
    stream: bool
    include_usage: bool
    n: int = 1
    max_tokens: int | None = None           # None: the server's default_max_tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    logprobs: bool = False                  # the sampled token's log-probability per token
    logit_bias: tuple[tuple[int, float], ...] = ()
    cache_salt: str | None = None
    ignore_eos: bool = False


# OpenAI fields kvshare accepts only at the value that asks for nothing.
def _none(v: Any) -> bool:
    return v is None


def _false(v: Any) -> bool:
    return v is None or v is False


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


_NEUTRAL_CHAT: dict[str, Callable[[Any], bool]] = {
    "tools": _empty, "tool_choice": lambda v: v in (None, "none"), "functions": _empty,
    "function_call": lambda v: v in (None, "none"), "parallel_tool_calls": lambda v: True,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "audio": _none, "modalities": lambda v: v is None or v == ["text"], "prediction": _none,
    "web_search_options": _none, "reasoning_effort": _none, "service_tier": lambda v: v in (None, "auto", "default"),
    "store": _false, "metadata": lambda v: True, "echo": _false,
}
_NEUTRAL_COMPLETION: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v in (None, ""), "echo": _false,
}
_COMMON = ("model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "seed", "stop",
           "presence_penalty", "frequency_penalty", "logit_bias", "user", "best_of",
           "ignore_eos", "cache_salt", "top_k", "min_tokens", "repetition_penalty")
CHAT_FIELDS = frozenset(_COMMON + ("messages", "max_completion_tokens", "logprobs", "top_logprobs")) | set(_NEUTRAL_CHAT)
COMPLETION_FIELDS = frozenset(_COMMON + ("prompt", "logprobs")) | set(_NEUTRAL_COMPLETION)


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(key, f"must be a number, got {v!r}")
    if not lo <= v <= hi:
        raise invalid(key, f"must be in [{lo:g}, {hi:g}], got {v}")
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(key, f"must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        raise invalid(key, f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _boolean(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(key, f"must be a boolean, got {v!r}")
    return v


def _check_fields(body: dict, known: frozenset[str], neutral: dict[str, Callable[[Any], bool]]) -> None:
    for key, v in body.items():
        if key not in known:
            raise invalid(key, "unrecognized request argument", code="unknown_parameter")
        if key in neutral and not neutral[key](v):
            raise unsupported(key)


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    words = [v] if isinstance(v, str) else v
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise invalid("stop", f"must be a string or a list of strings, got {v!r}")
    if len(words) > MAX_STOP:
        raise invalid("stop", f"at most {MAX_STOP} sequences, got {len(words)}")
    return tuple(w for w in words if w)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise invalid("logit_bias", f"must be an object {{token id: bias}}, got {v!r}")
    out = []
    for tok, b in v.items():
        try:
            tok_id = int(tok)
        except (TypeError, ValueError):
            raise invalid("logit_bias", f"key {tok!r} is not a token id") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise invalid("logit_bias", f"bias of {tok} must be a number in [-100, 100], got {b!r}")
        out.append((tok_id, float(b)))
    return tuple(out)


def _common(body: dict, prompt: str, *, max_tokens: int | None, logprobs: bool) -> GenerationSpec:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "is required (a string)")
    stream = _boolean(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise invalid("stream_options", "is only allowed with stream: true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("stream_options", f"kvshare reads only include_usage, got {opts!r}")
        if opts.get("continuous_usage_stats"):
            raise unsupported("stream_options.continuous_usage_stats")
        include_usage = bool(opts.get("include_usage"))
    n = _integer(body, "n", 1, MAX_N) or 1
    best_of = _integer(body, "best_of", 1)
    if best_of is not None and best_of != n:
        raise unsupported("best_of", f"kvshare generates exactly n candidates (best_of must equal n = {n}, got "
                                     f"{best_of})")
    user, salt = body.get("user"), body.get("cache_salt")
    for key, v in (("user", user), ("cache_salt", salt)):
        if v is not None and not isinstance(v, str):
            raise invalid(key, f"must be a string, got {v!r}")
    seed = _integer(body, "seed", -(2 ** 63), 2 ** 64 - 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise invalid("top_p", "must be > 0")
    repetition = body.get("repetition_penalty")
    return GenerationSpec(
        model=model, prompt=prompt, stream=stream, include_usage=include_usage, n=n, max_tokens=max_tokens,
        temperature=temperature, top_p=top_p, top_k=_integer(body, "top_k", -1) or 0,
        seed=None if seed is None else seed % 2 ** 64,   # OpenAI allows negative seeds; the server takes uint64
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=None if repetition is None else _number(body, "repetition_penalty", 1.0, 1e-6, 1e6),
        min_tokens=_integer(body, "min_tokens", 0) or 0, stop=_stop(body), logprobs=logprobs,
        logit_bias=_logit_bias(body), cache_salt=salt if salt is not None else user,
        ignore_eos=_boolean(body, "ignore_eos"))


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported(f"messages[{i}].content[{j}]", f"kvshare takes text parts only, got {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"messages[{i}].content", f"must be a string or a list of text parts, got {content!r}")


def chat_messages(body: dict) -> list[dict]:
    """The messages as {"role", "content"} with text content; tool calls and images refused by name."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "is required (a non-empty list)")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", "must be an object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise unsupported(f"messages[{i}].role", f"kvshare takes system, developer, user and assistant "
                                                     f"messages, got {role!r}")
        for key in m:
            if key not in ("role", "content", "name"):
                raise unsupported(f"messages[{i}].{key}")
        # the templates of the served families know "system", not OpenAI's newer "developer"
        out.append({"role": "system" if role == "developer" else role, "content": _message_text(i, m.get("content"))})
    return out


def chat_spec(body: dict, prompt_text: Callable[[list[dict]], str]) -> GenerationSpec:
    _check_fields(body, CHAT_FIELDS, _NEUTRAL_CHAT)
    messages = chat_messages(body)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    logprobs = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, 20)
    if top is not None and not logprobs:
        raise invalid("top_logprobs", "needs logprobs: true")
    if top:
        raise unsupported("top_logprobs", "kvshare returns the sampled token's log-probability only (top_logprobs "
                                          "0), not the most likely alternatives")
    spec = _common(body, "", max_tokens=max_tokens, logprobs=logprobs)
    return _with_prompt(spec, prompt_text(messages))


def completion_spec(body: dict) -> GenerationSpec:
    _check_fields(body, COMPLETION_FIELDS, _NEUTRAL_COMPLETION)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise unsupported("prompt", "kvshare takes one prompt string per request (not token ids or a batch)")
    if not prompt:
        raise invalid("prompt", "must not be empty")
    lp = _integer(body, "logprobs", 0, 5)
    if lp:
        raise unsupported("logprobs", "kvshare returns the sampled token's log-probability only (logprobs 0), "
                                      "not the most likely alternatives")
    return _common(body, prompt, max_tokens=_integer(body, "max_tokens", 1), logprobs=lp is not None)


def _with_prompt(spec: GenerationSpec, prompt: str) -> GenerationSpec:
    from dataclasses import replace

    return replace(spec, prompt=prompt)
