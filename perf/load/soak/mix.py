"""The requests of the soak: for each model, what a normal, a long and a bad request look like.

Text models (`ensemble`, `llm_bls`) and the token model (`llm_engine`) take kvshare_client's
GenerationRequest tensors; `vllm_model` takes Triton's vLLM-backend tensors (rank 1, no batch
dimension, sampling parameters as JSON strings). Bad inputs carry the name the refusal must mention.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvshare_client.types import GenerationRequest
from kvshare_client.wire import WireTensor, build_tensors
from kvshare_client.workload import DEFAULT_PROMPTS, synthetic_token_requests

MODELS = ("ensemble", "llm_bls", "vllm_model", "llm_engine")
# Models whose stream cancel reaches the engine; Triton 2.51 does not cancel a running ensemble
# step, so an abandoned ensemble request runs to its end (docs/decisions.md).
CANCELLABLE = frozenset({"llm_bls", "vllm_model", "llm_engine"})

PROMPTS = DEFAULT_PROMPTS + (
    "Describe a cat to someone who has never seen one. Use plain words, short sentences and mention "
    "the tail, the whiskers, the way it sits in the sun and how it sounds when it is happy.",
    "写一首关于秋天的短诗。",
)
TOKEN_PROMPTS = synthetic_token_requests(16, 48, seed=1) + synthetic_token_requests(4, 200, seed=2)


@dataclass(frozen=True)
class Shape:
    """How much to generate: max_tokens, whether to ignore EOS, whether to stream."""

    max_tokens: int
    stream: bool = True
    ignore_eos: bool = False


@dataclass(frozen=True)
class BadInput:
    tensors: tuple[WireTensor, ...]
    field: str          # what the refusal must name
    label: str


def _vllm_tensors(prompt: str, stream: bool, sampling: dict) -> tuple[WireTensor, ...]:
    return (WireTensor("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_)),
            WireTensor("stream", "BOOL", np.array([stream], dtype=np.bool_)),
            WireTensor("sampling_parameters", "BYTES", np.array([json.dumps(sampling).encode()], dtype=np.object_)),
            WireTensor("return_finish_reason", "BOOL", np.array([True], dtype=np.bool_)))


def request_tensors(model: str, shape: Shape, rng: random.Random) -> tuple[WireTensor, ...]:
    """A valid request for model: a prompt from the pool, sampled or greedy, of the given shape."""
    temperature = rng.choice((0.0, 0.7, 1.0))
    if model == "vllm_model":
        sampling = {"max_tokens": str(shape.max_tokens), "temperature": str(temperature)}
        if shape.ignore_eos:
            sampling["ignore_eos"] = "true"
        return _vllm_tensors(rng.choice(PROMPTS), shape.stream, sampling)
    common = dict(max_tokens=shape.max_tokens, stream=shape.stream, temperature=temperature,
                  ignore_eos=True if shape.ignore_eos else None, seed=rng.randrange(1 << 30))
    if model == "llm_engine":
        base = rng.choice(TOKEN_PROMPTS)
        return build_tensors(GenerationRequest(input_ids=base.input_ids, **common))
    return build_tensors(GenerationRequest(prompt=rng.choice(PROMPTS), apply_chat_template=rng.random() < 0.5,
                                           **common))


def _text(model: str, field_value: dict, label: str, field: str) -> BadInput:
    req = GenerationRequest(prompt=field_value.pop("prompt", "Hello"), **field_value)
    return BadInput(build_tensors(req), field, f"{model}: {label}")


def bad_inputs(model: str) -> tuple[BadInput, ...]:
    """Invalid requests for model, each with the field its refusal must name."""
    if model == "vllm_model":
        return (BadInput(_vllm_tensors("Hello", True, {"bogus_key": "1"}), "bogus_key", "unknown sampling key"),
                BadInput(_vllm_tensors("Hello", True, {"temperature": "-1"}), "temperature", "temperature < 0"),
                BadInput(_vllm_tensors("Hello", True, {"max_tokens": "0"}), "max_tokens", "max_tokens 0"))
    if model == "llm_engine":
        return (BadInput(build_tensors(GenerationRequest(input_ids=(1, 2, 10**6), max_tokens=4)), "input_ids",
                         "token id past the vocabulary"),
                BadInput(build_tensors(GenerationRequest(input_ids=(1, 2, 3), max_tokens=-5)), "max_tokens",
                         "max_tokens < 0"),
                BadInput(build_tensors(GenerationRequest(input_ids=(1, 2, 3), top_p=1.5)), "top_p", "top_p > 1"))
    return (_text(model, {"prompt": "   "}, "empty text", "text_input"),
            _text(model, {"temperature": -0.5}, "temperature < 0", "temperature"),
            _text(model, {"max_tokens": 0}, "max_tokens 0", "max_tokens"),
            _text(model, {"top_p": 1.5}, "top_p > 1", "top_p"))


def pick_bad_input(model: str, rng: random.Random) -> BadInput:
    return rng.choice(bad_inputs(model))


def normal_shape(rng: random.Random) -> Shape:
    """Mostly short answers (many requests, many page frees), now and then a long one (pool pressure)."""
    if rng.random() < 0.1:
        return Shape(max_tokens=96, ignore_eos=True)
    return Shape(max_tokens=rng.choice((8, 16, 32, 48)))


def cancel_shape(model: str) -> Shape:
    # An ensemble "cancel" runs to its end on the server: keep it short.
    return Shape(max_tokens=160 if model in CANCELLABLE else 32, ignore_eos=True)


def abandon_after(rng: random.Random) -> int:
    """After how many responses a cancelling / disconnecting client gives up."""
    return rng.randint(1, 4)


def choose_model(rng: random.Random, models: Optional[tuple[str, ...]] = None) -> str:
    return rng.choice(models or MODELS)
