"""Prompt workloads for load generators: files of requests, or synthetic token ids.

File formats (picked by extension):
  .jsonl  one JSON object per line: {"prompt": "..."} or {"input_ids": [...]}, plus any other
          GenerationRequest field ({"prompt": "Hi", "max_tokens": 64, "cache_salt": "a"})
  .json   a list of such objects (or {"requests": [...]})
  other   plain text, one prompt per non-empty line
Options given to the load generator (``overrides``) apply on top of every entry, so that a run's
command line says what every request does (e.g. a forced output length).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from .types import GenerationRequest

_FIELDS = {f.name for f in dataclasses.fields(GenerationRequest)}

# Used when no workload file is given: short, varied instructions that fit any small model.
DEFAULT_PROMPTS = (
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three uses of a hash table.",
    "What is the capital of France?",
    "Give me a short recipe for pancakes.",
    "Summarise the plot of Hamlet in two sentences.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish, French and German.",
)


def request_from_mapping(
    entry: Mapping[str, Any], overrides: Optional[Mapping[str, Any]] = None, *, where: str = ""
) -> GenerationRequest:
    """A GenerationRequest from a workload entry; unknown keys are an error, not silently ignored."""
    unknown = set(entry) - _FIELDS
    if unknown:
        raise ValueError(f"{where}unknown request field(s) {sorted(unknown)}; known: {sorted(_FIELDS)}")
    set_overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if {"prompt", "input_ids"} & set(set_overrides):
        raise ValueError("overrides apply sampling options; the prompt comes from the workload")
    return GenerationRequest(**{**entry, **set_overrides})


def load_workload(path: str | Path, overrides: Optional[Mapping[str, Any]] = None) -> tuple[GenerationRequest, ...]:
    """Read a workload file (see module doc) into requests."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    entries: list[tuple[str, Mapping[str, Any]]] = []
    if p.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                entries.append((f"{p.name}:{n}: ", json.loads(line)))
    elif p.suffix == ".json":
        data = json.loads(text)
        items: Iterable[Any] = data["requests"] if isinstance(data, dict) else data
        entries = [(f"{p.name}[{i}]: ", e) for i, e in enumerate(items)]
    else:
        entries = [(f"{p.name}:{n}: ", {"prompt": line}) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not entries:
        raise ValueError(f"workload {p} has no requests")
    return tuple(request_from_mapping(e, overrides, where=w) for w, e in entries)


def synthetic_token_requests(
    count: int,
    input_len: int,
    *,
    vocab_low: int = 1000,
    vocab_high: int = 30000,
    seed: int = 0,
    overrides: Optional[Mapping[str, Any]] = None,
) -> tuple[GenerationRequest, ...]:
    """``count`` requests of ``input_len`` random token ids (for llm_engine; deterministic per seed).

    The id range stays clear of a tokenizer's special tokens at the low end of the vocabulary.
    """
    if count < 1 or input_len < 1:
        raise ValueError("count and input_len must be >= 1")
    rng = random.Random(seed)
    return tuple(
        request_from_mapping({"input_ids": [rng.randrange(vocab_low, vocab_high) for _ in range(input_len)]}, overrides)
        for _ in range(count)
    )


class RoundRobin:
    """Cycles through requests from a given offset (each load-test user starts somewhere else)."""

    def __init__(self, requests: tuple[GenerationRequest, ...], start: int = 0) -> None:
        if not requests:
            raise ValueError("no requests")
        self._requests = requests
        self._i = start % len(requests)

    def next(self) -> GenerationRequest:
        r = self._requests[self._i]
        self._i = (self._i + 1) % len(self._requests)
        return r
