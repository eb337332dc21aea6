"""Incremental detokenization with stop strings.

Deltas are cut so that joining them equals ``tokenizer.decode(all output ids)``: text is released
only when its UTF-8 is complete (no U+FFFD from a split character), and any tail that could be the
start of a stop string is held back until it is known not to be one, so a stop string is never
emitted even when it spans several tokens or chunks.
"""
from __future__ import annotations

import logging

log = logging.getLogger("kvshare.engine")

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._prefix_offset = 0     # decoding restarts here, one step back, so merges/spaces come out right
        self._read_offset = 0       # text of ids[:read_offset] has been produced
        self._emitted: list[str] = []
        self._emitted_len = 0
        self._pending = ""          # produced but held back (could begin a stop string)
        self.stopped = False        # a stop string matched; generation must end

    @property
    def text(self) -> str:
        return "".join(self._emitted)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int, *, check_stop: bool = True) -> str:
        """Feeds one generated token; returns the text that may be sent now ("" if none)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""   # an incomplete UTF-8 sequence, or a token that adds no text yet
        self._pending += new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(check_stop)

    def _release(self, check_stop: bool) -> str:
        if check_stop and self._stop:
            hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._emit(self._pending[: min(hits)])
            hold = self._held_back_len()
            out, self._pending = self._pending[: len(self._pending) - hold], self._pending[len(self._pending) - hold:]
            return self._emit(out)
        out, self._pending = self._pending, ""
        return self._emit(out)

    def _held_back_len(self) -> int:
        """Length of the longest tail of pending text that is a proper prefix of a stop string."""
        tail = self._pending[-(self._max_stop - 1):] if self._max_stop > 1 else ""
        for n in range(len(tail), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self._stop):
                return n
        return 0

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
            self._emitted_len += len(text)
        return text

    def finish(self) -> str:
        """At the end of generation: the rest of the text (nothing after a stop string)."""
        if self.stopped:
            return ""
        full = self._decode(self._ids)
        emitted = self.text
        if not full.startswith(emitted):
            # Some tokenizers decode differently in pieces; keep what was sent and say so.
            log.warning("incremental text diverged from the full decode; %d chars not re-sent", len(full))
            return self._emit(self._pending)
        self._pending = ""
        return self._emit(full[len(emitted):])
