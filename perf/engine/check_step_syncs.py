"""Where an engine step makes the host wait for the GPU, by call site and step kind (CUDA only).

Overlap scheduling (EngineConfig.overlap_schedule) builds step N+1 on the host while step N runs
on the GPU. One synchronising call anywhere in a step (an `.item()`, a blocking copy, iterating a
device tensor) puts all of the host's work back on the critical path; the step then costs its GPU
time plus its host time. The one wait the design has is `LaunchedStep.tokens()`, which reads the
previous step's ids once they are on the host.

This runs the engine, closed loop, on the mixed trace's requests under
`torch.cuda.set_sync_debug_mode("warn")` (after a warm-up) and prints every distinct Python stack
that synchronised, with how often it did per step kind. With --min-tokens the requests force their
length as the serving load does (min_tokens = max_tokens).

    python perf/engine/check_step_syncs.py [--model dummy:llama-2-7b] [--min-tokens] [--steps 300]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.core.workload_traces import make_trace  # noqa: E402
from perf.engine.step_profile import step_kind  # noqa: E402

from kvshare.engine.engine import LLMEngine  # noqa: E402
from kvshare.engine.engine_config import EngineConfig  # noqa: E402
from kvshare.sampling_params import SamplingParams  # noqa: E402

OURS = ("kvshare", "perf")      # frames shown: the project's own


class SyncRecorder:
    """Collects the synchronising calls of the step being run; `step_done(kind)` files them under
    (step kind, message, the project's frames of the stack)."""

    def __init__(self):
        self._current: list[tuple[str, tuple[str, ...]]] = []
        self.sites: collections.Counter = collections.Counter()
        self.kinds: collections.Counter = collections.Counter()

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        text = str(message).splitlines()[0][:100]
        if "synchroniz" not in text.lower():
            return
        frames = [f for f in traceback.extract_stack()[:-1] if any(p in f.filename for p in OURS)]
        self._current.append((text, tuple(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-6:])))

    def step_done(self, kind: str) -> None:
        self.kinds[kind] += 1
        for text, stack in self._current:
            self.sites[(kind, text, stack)] += 1
        self._current = []


def closed_loop(engine: LLMEngine, requests, params, concurrency: int, steps: int,
                after_step: Callable[[], None] | None = None) -> int:
    """Steps the engine up to `steps` times, keeping `concurrency` requests in flight; returns steps run."""
    pending, in_flight, n = list(requests), set(), 0
    while n < steps and (pending or in_flight):
        while pending and len(in_flight) < concurrency:
            r = pending.pop(0)
            engine.add_request(str(r.request_id), list(r.prompt_ids), params(r))
            in_flight.add(str(r.request_id))
        for out in engine.step():
            if out.finished:
                in_flight.discard(out.request_id)
        if after_step is not None:
            after_step()
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-2-7b")
    ap.add_argument("--min-tokens", action="store_true", help="min_tokens = max_tokens (the serving load's params)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--warmup-steps", type=int, default=60)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to check")
        return 0
    engine = LLMEngine(EngineConfig(model=args.model, device="cuda", dtype="float16", kv_cache_memory_gb=8,
                                    max_running=max(args.concurrency, 1), max_model_len=4096))
    vocab = engine.model_config.vocab_size
    trace = make_trace("mixed")

    def params(r) -> SamplingParams:
        return SamplingParams(max_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=True,
                              min_tokens=r.max_new_tokens if args.min_tokens else 0)

    # the warm-up's prompts are shifted by one id: the checked requests find none of them cached
    shifted = [replace(r, prompt_ids=tuple((t + 1) % vocab for t in r.prompt_ids)) for r in trace.requests]
    closed_loop(engine, shifted[:args.concurrency * 2], params, args.concurrency, args.warmup_steps)
    while engine.has_work:          # the warm-up's requests end before the checked steps begin
        engine.step()
    recorder = SyncRecorder()
    requests = [r for r in trace.requests if len(r.prompt_ids) + r.max_new_tokens <= 4096]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = recorder.showwarning
        torch.cuda.set_sync_debug_mode("warn")
        try:
            ran = closed_loop(engine, requests, params, args.concurrency, args.steps,
                              after_step=lambda: recorder.step_done(step_kind(engine.last_step)))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.close()
    kinds = recorder.kinds
    print(f"{ran} steps ({'min_tokens = max_tokens' if args.min_tokens else 'no min_tokens'}) by kind: {dict(kinds)}")
    rows = []
    for (kind, text, stack), count in recorder.sites.most_common():
        per_step = count / max(kinds[kind], 1)
        rows.append(dict(kind=kind, message=text, stack=list(stack), count=count, per_step=round(per_step, 3)))
        print(f"\n{count:6d} x ({per_step:.2f} per step) in {kind} steps: {text}")
        for frame in stack:
            print(f"         {frame}")
    if args.json:
        args.json.write_text(json.dumps(dict(min_tokens=args.min_tokens, steps=ran, kinds=dict(kinds), sites=rows),
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
