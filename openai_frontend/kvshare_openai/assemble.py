"""Deltas of one request to OpenAI's objects: whole completions, SSE chunks, usage, logprobs."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from .request import GenerationSpec
from .triton_stream import Delta

CHAT, COMPLETION = "chat", "completion"
# kvshare's finish reasons that OpenAI has no word for end the choice as "stop" would not be honest:
# a cancelled request is never answered (its client left), an error becomes an HTTP error.
_FINISH = {"stop": "stop", "length": "length"}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False           # chat streams open each choice with a role delta


class Assembler:
    """Accumulates one request's deltas; renders what OpenAI's wire format wants at each step."""

    def __init__(self, kind: str, spec: GenerationSpec, model: str, token_text: Callable[[int], str]):
        self.kind, self.spec, self.model = kind, spec, model
        self._token_text = token_text
        self.id = ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._choices = [_Choice() for _ in range(spec.n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0

    # -- accumulation ----------------------------------------------------------------------------
    def add(self, d: Delta) -> None:
        c = self._choices[d.index]
        c.text.append(d.text)
        c.token_ids += d.token_ids
        c.log_probs += d.log_probs
        if d.finish_reason:
            c.finish_reason = _FINISH.get(d.finish_reason, d.finish_reason)
        if d.prompt_tokens:
            self.prompt_tokens = d.prompt_tokens
        if d.index == 0 and d.cached_tokens:      # the forks of n > 1 report the prompt they share as cached
            self.cached_tokens = d.cached_tokens

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self._choices)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    # -- logprobs --------------------------------------------------------------------------------
    def _covered(self, ids, lps, text: str, finish_reason: str | None):
        """The tokens the text shows: a stop string is withheld from the text while its tokens were
        generated, and OpenAI's logprobs list the tokens of the returned text."""
        if finish_reason != "stop" or not self.spec.stop or not self.spec.logprobs:
            return ids, lps
        kept, at = 0, 0
        for t in ids:
            at += len(self._token_text(t))
            if at > len(text):
                break
            kept += 1
        return ids[:kept], lps[:kept]

    def _chat_logprobs(self, ids, lps) -> dict | None:
        if not self.spec.logprobs:
            return None
        content = []
        for t, lp in zip(ids, lps):
            text = self._token_text(t)
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")), "top_logprobs": []})
        return {"content": content}

    def _completion_logprobs(self, ids, lps, offset: int) -> dict | None:
        if not self.spec.logprobs:
            return None
        tokens = [self._token_text(t) for t in ids]
        offsets, at = [], offset
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": None, "text_offset": offsets}

    # -- whole responses -------------------------------------------------------------------------
    def response(self) -> dict:
        choices = []
        for i, c in enumerate(self._choices):
            text = "".join(c.text)
            ids, lps = self._covered(c.token_ids, c.log_probs, text, c.finish_reason)
            if self.kind == CHAT:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": self._chat_logprobs(ids, lps), "finish_reason": c.finish_reason})
            else:
                choices.append({"index": i, "text": text,
                                "logprobs": self._completion_logprobs(ids, lps, 0),
                                "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "chat.completion" if self.kind == CHAT else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage(),
                "system_fingerprint": None}

    # -- stream chunks ---------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.kind == CHAT else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, "system_fingerprint": None}
        if self.spec.include_usage:
            out["usage"] = usage
        return out

    def chunks(self, d: Delta) -> list[dict]:
        """The chunks one delta becomes (add() it first)."""
        c = self._choices[d.index]
        ids, lps = self._covered(d.token_ids, d.log_probs, d.text, d.finish_reason)
        out = []
        if self.kind == CHAT:
            if not c.started:
                c.started = True
                out.append(self._chunk([{"index": d.index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]))
            if d.text or d.token_ids:
                out.append(self._chunk([{"index": d.index, "delta": {"content": d.text},
                                         "logprobs": self._chat_logprobs(ids, lps),
                                         "finish_reason": None}]))
            if d.finish_reason:
                out.append(self._chunk([{"index": d.index, "delta": {}, "logprobs": None,
                                         "finish_reason": c.finish_reason}]))
        elif d.text or d.token_ids or d.finish_reason:
            before = len("".join(c.text)) - len(d.text)
            out.append(self._chunk([{"index": d.index, "text": d.text,
                                     "logprobs": self._completion_logprobs(ids, lps, before),
                                     "finish_reason": c.finish_reason if d.finish_reason else None}]))
        return out

    def usage_chunk(self) -> dict:
        return self._chunk([], self.usage())
