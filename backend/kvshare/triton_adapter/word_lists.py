"""Word lists of the TensorRT-LLM contract (bad_words, embedding_bias_words) as token ids.

Each word is tokenized on its own without special tokens, as TensorRT-LLM's preprocessing does, so
" intelligence" and "intelligence" are different words. Stop words are not here: the engine matches
them on the decoded text (a stop word tokenized on its own would miss most of its occurrences).
"""
from __future__ import annotations

import dataclasses

from ..engine.outputs import InvalidRequest
from .inputs import GenerationRequest


def word_ids(tokenizer, word: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(word, add_special_tokens=False))


def resolve_words(request: GenerationRequest, tokenizer) -> GenerationRequest:
    """The request with its bad words and embedding bias as token ids in its SamplingParams."""
    if not (request.bad_words or request.embedding_bias):
        return request
    if tokenizer is None:
        name = "bad_words" if request.bad_words else "embedding_bias_words"
        raise InvalidRequest(name, "the served model has no tokenizer to turn words into token ids")
    bad = tuple(ids for ids in (word_ids(tokenizer, w) for w in request.bad_words) if ids)
    bias: dict[int, float] = {}
    for word, weight in request.embedding_bias:
        for token in word_ids(tokenizer, word):
            bias[token] = bias.get(token, 0.0) + weight
    params = dataclasses.replace(request.params, bad_words=request.params.bad_words + bad,
                                 logit_bias=request.params.logit_bias + tuple(sorted(bias.items())))
    return dataclasses.replace(request, params=params)
