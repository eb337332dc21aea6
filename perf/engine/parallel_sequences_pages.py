"""KV pages held by parallel sampling (num_return_sequences n) and beam search, with page sharing
against a copy per sequence, in one run.

    .venv/bin/python -m perf.engine.parallel_sequences_pages [--prompt-tokens 256] [--max-tokens 48] [--json OUT]

Sharing: the n sequences fork from one prefill (shared full pages, the partial last page copied on
write); the beams of a beam search share their common prefix through the prefix cache. Copy per
sequence: the same requests with prefix caching off and no fork, each sequence computing and holding
its own prompt. "Pages held" is the most pages referenced by the request's sequences at once (the
pool's active pages, read right after each step's plan is made). For beam search the
copy baseline is each beam holding its whole own table (prompt + its tokens), counted from the same
run's beams at the step where they hold the most. The vLLM paper (Kwon et al., 2023) reports 6-30%
saved for parallel sampling and up to 55% for beam search on its traces; the figures here depend on
the prompt/output ratio, printed with them.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, asdict
from pathlib import Path

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.sampling_params import SamplingParams

TEXT = ("The lighthouse keeper kept a log of every ship that passed the point, the weather at dawn and "
        "dusk, the colour of the sea and the birds that rested on the gallery rail. ")


@dataclass(frozen=True)
class Row:
    case: str
    prompt_tokens: int
    output_tokens: int
    pages_shared: int
    pages_copied: int

    @property
    def saved(self) -> float:
        return 1.0 - self.pages_shared / self.pages_copied


def prompt_ids(engine: LLMEngine, n_tokens: int) -> list[int]:
    ids = engine.tokenizer.encode(TEXT * (n_tokens // 20 + 2))
    return ids[:n_tokens]


def peak_active(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams, str | None]]) -> tuple[int, dict]:
    """The most pages referenced at once, read from the pool right after each step's plan is made
    (every admitted sequence holds its pages then; a beam step's requests end within their step)."""
    peak = 0
    schedule = engine.scheduler.schedule

    def sampled_schedule():
        nonlocal peak
        plan = schedule()
        peak = max(peak, engine.scheduler.kv.pool.num_active)
        return plan

    engine.scheduler.schedule = sampled_schedule
    for rid, ids, params, fork_of in requests:
        engine.add_request(rid, ids, params, fork_of=fork_of)
    finals = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    engine.scheduler.schedule = schedule
    engine.check_integrity()
    assert engine.stats().pool.active == 0, "pages leaked"
    return peak, finals


def parallel(shared: LLMEngine, copied: LLMEngine, ids: list[int], n: int, max_tokens: int, seed: int) -> Row:
    def reqs(fork: bool):
        return [(f"s{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i, ignore_eos=True),
                 "s0" if fork and i else None) for i in range(n)]
    held_shared, _ = peak_active(shared, reqs(True))
    held_copied, _ = peak_active(copied, reqs(False))
    return Row(f"parallel sampling n={n}", len(ids), max_tokens, held_shared, held_copied)


def beam(shared: LLMEngine, ids: list[int], width: int, max_tokens: int) -> Row:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, beam_width=width, ignore_eos=True)
    held, finals = peak_active(shared, [("b", ids, params, None)])
    page = shared.kv.page_size
    longest = max(len(b.token_ids) for b in finals["b"].beams)
    # every beam its own table at the longest step: prompt + its tokens so far (the last one not yet in KV)
    copied = width * -(-(len(ids) + longest - 1) // page)
    return Row(f"beam search width={width}", len(ids), max_tokens, held, copied)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--json", type=Path, help="write the table as JSON here")
    args = ap.parse_args(argv)
    base = dict(model=args.model, max_running=16, debug_checks=True)
    shared = LLMEngine(EngineConfig(**base))
    copied = LLMEngine(EngineConfig(**base, enable_prefix_caching=False))
    ids = prompt_ids(shared, args.prompt_tokens)
    rows = [parallel(shared, copied, ids, n, args.max_tokens, seed=7) for n in (1, 4, 8)]
    rows.append(beam(shared, ids, 4, args.max_tokens))
    print(f"page size {shared.kv.page_size}, prompt {len(ids)} tokens, {args.max_tokens} new tokens per sequence")
    print(f"{'case':<28}{'pages, shared':>15}{'pages, a copy each':>20}{'saved':>8}")
    for r in rows:
        print(f"{r.case:<28}{r.pages_shared:>15}{r.pages_copied:>20}{r.saved:>8.0%}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) | {"saved": r.saved} for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
