"""Host time of one engine decode step at batch B, without the model: what the GPU waits for.

On the H200 a decode step at batch 256 took ~15 ms with CUDA graphs against ~10 ms of kernels, so
everything the engine does on the host between two replays matters. This runs the real LLMEngine
(scheduler, page tables, input-buffer fill, sampling bookkeeping, outputs) on the CPU with a
tiny model whose forward is replaced by "fill the decode buffers, return fixed ids": the time per
step is then host work only (after gc.freeze, as the server runs; --no-gc-freeze without). --profile prints a cProfile of the decode steps.

    python perf/engine/profile_engine_host.py [--batch 256] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.engine.gc_tuning import freeze_startup_heap
from kvshare.runtime.input_buffers import DecodeInputBuffers
from kvshare.sampling_params import SamplingParams


def host_only_execute(engine: LLMEngine, max_batch: int):
    """Replaces ModelRunner.execute: decode steps fill the persistent buffers as a graph replay would."""
    ps = engine.kv.page_size
    buffers = DecodeInputBuffers(max_batch, -(-engine.max_model_len // ps), ps, torch.device("cpu"))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def execute(chunks):
        if all(len(c.token_ids) == 1 for c in chunks):
            buffers.fill([(c.token_ids[0], c.start, c.page_table) for c in chunks], len(chunks))
        return [rng.randrange(3, vocab) for c in chunks if c.sampling is not None]

    return execute


def run(batch: int, prompt: int, new: int, profile: bool, gc_freeze: bool = True) -> None:
    cfg = EngineConfig(model="dummy:tiny-llama", device="cpu", dtype="float32", max_running=batch,
                       max_step_tokens=batch * prompt, max_prefill_chunk=prompt, num_pages=batch * 32 + 64,
                       max_model_len=512)
    engine = LLMEngine(cfg)
    engine.runner.execute = host_only_execute(engine, batch)
    if gc_freeze:
        freeze_startup_heap()
    rng = random.Random(1)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(3, 256) for _ in range(prompt)], params)
    engine.step()                                   # the prefill step
    prof = cProfile.Profile() if profile else None
    steps, t0 = 0, time.perf_counter()
    if prof:
        prof.enable()
    while engine.has_work:
        engine.step()
        steps += 1
    if prof:
        prof.disable()
    dt = time.perf_counter() - t0
    print(f"batch {batch}: {steps} decode steps, {1e3 * dt / steps:.2f} ms host time per step")
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-gc-freeze", action="store_true", help="leave the start-up heap to the collector")
    a = ap.parse_args()
    run(a.batch, a.prompt, a.new, a.profile, gc_freeze=not a.no_gc_freeze)


if __name__ == "__main__":
    main()
