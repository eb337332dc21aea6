"""Beam search over shared pages, driven above the scheduler.

Each step runs every live beam as a one-token request whose prompt is the request's prompt plus the
beam's tokens, asking for the K best next tokens' log-probabilities (vLLM v1 drives beam search the
same way). The pages do the sharing: a beam's request finds its parent's full pages in the prefix
cache and copies the partially filled last page (copy on write), so only the new token is computed;
beams that nobody continues are dropped with their request, and their pages become evictable.

    step t:    prompt+[a]          prompt+[b]            (K candidates each)
                   │   ╲               │
    step t+1:  prompt+[a,x]  prompt+[a,y]  prompt+[b,z]     pages of prompt shared by all,
                                                            a's last page copied for x and y

The selection follows HF transformers' beam search (``generate(num_beams=W)``, early_stopping=False)
step for step, so greedy beams match it token for token: the top K = max(2, 1 + #end ids) * W
continuations by cumulative log-probability; among the first W, those that end (an end id, or the
length limit) become finished hypotheses scored cum_logprob / len ** length_penalty; the best W
that did not end continue; the search stops when every continuation ends, or when W hypotheses are
finished and the best running beam, scored at its current length, cannot beat the worst of them.
Pure Python on the candidates: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

NEG = -1.0e9      # HF's "impossible" score for empty hypothesis slots and ended continuations


@dataclass(frozen=True)
class BeamState:
    token_ids: tuple[int, ...]
    cum_logprob: float
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Hypothesis:
    score: float                  # cum_logprob / len ** length_penalty (NEG for an empty slot)
    beam: BeamState | None


@dataclass(frozen=True)
class Candidate:
    cum_logprob: float
    parent: int                   # index into the running beams
    token: int
    logprob: float


class BeamSearch:
    def __init__(self, width: int, max_tokens: int, end_ids: frozenset[int], *, length_penalty: float = 1.0,
                 ignore_end: bool = False):
        if width < 2:
            raise ValueError(f"beam search needs width >= 2, got {width}")
        self.width = width
        self.max_tokens = max_tokens
        self.end_ids = frozenset() if ignore_end else end_ids
        self.length_penalty = length_penalty
        self.num_candidates = max(2, 1 + len(self.end_ids)) * width
        # Step 0 has one beam (the prompt); HF's other W-1 start at NEG and never win a slot.
        self.running: list[BeamState] = [BeamState((), 0.0, ())]
        self.finished: list[Hypothesis] = [Hypothesis(NEG, None)] * width
        self._slots_filled = [False] * width
        self._improvable = True
        self.done = False
        self.steps = 0

    def step(self, top: list[list[tuple[int, float]]]) -> None:
        """top[j]: the (token, logprob) pairs of running beam j's next token, best first (>= K of them)."""
        if self.done:
            raise RuntimeError("the beam search is finished")
        if len(top) != len(self.running):
            raise ValueError(f"{len(top)} candidate lists for {len(self.running)} running beams")
        cands = sorted((Candidate(beam.cum_logprob + lp, j, tok, lp)
                        for j, beam in enumerate(self.running) for tok, lp in top[j]),
                       key=lambda c: -c.cum_logprob)[:self.num_candidates]
        length = len(self.running[0].token_ids) + 1
        ends = [c.token in self.end_ids or length >= self.max_tokens for c in cands]
        new_beams = [self._extend(c) for c in cands]
        # f. finished hypotheses: only the first W candidates may end the search's sentences
        penalty = length ** self.length_penalty
        offered = [Hypothesis(c.cum_logprob / penalty + (0.0 if self._improvable else NEG), beam)
                   for i, (c, beam, end) in enumerate(zip(cands, new_beams, ends)) if i < self.width and end]
        merged = [(h, filled) for h, filled in zip(self.finished, self._slots_filled)] + [(h, True) for h in offered]
        merged.sort(key=lambda item: -item[0].score)
        merged = merged[:self.width]
        self.finished = [h for h, _ in merged]
        self._slots_filled = [filled for _, filled in merged]
        # e. the best W continuations that did not end go on
        ranked = sorted(range(len(cands)), key=lambda i: -(cands[i].cum_logprob + (NEG if ends[i] else 0.0)))
        keep = [i for i in ranked[:self.width] if not ends[i]]
        self.running = [new_beams[i] for i in keep]
        self.steps += 1
        # g. can a running beam still beat the worst finished hypothesis? (early_stopping=False)
        if self.running and all(self._slots_filled):
            best = self.running[0].cum_logprob / length ** self.length_penalty
            self._improvable = self._improvable and best > min(h.score for h in self.finished)
        self.done = not self.running or not self._improvable or all(ends)

    def best(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first (n <= width)."""
        return [h for h in self.finished[:n] if h.beam is not None]

    def _extend(self, c: Candidate) -> BeamState:
        parent = self.running[c.parent]
        return BeamState(parent.token_ids + (c.token,), c.cum_logprob, parent.logprobs + (c.logprob,))
