"""Where a decode step's time goes on the GPU: engine step vs graph replay alone vs kernels.

For batch 64 and then 256 (Llama-2-7B shape, fp16, random weights, 128-token prompts) it measures
  - engine ms/step: LLMEngine.step() with CUDA graphs (what the offline benchmark sees),
  - replay ms/step: the captured graph replayed back to back (GPU time, no host work between),
  - per-kernel CUDA time of one eager forward of the same batch (torch.profiler), grouped.
engine - replay is the host time the GPU waits for; the kernel table says which kernels to speed up.

    python perf/engine/profile_decode.py [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
import sys
from pathlib import Path

import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.runtime.cuda_graph_runner import resolve_future_ids
from kvshare.sampling_params import SamplingParams

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.engine.kernel_profile import kernel_table, print_kernel_table  # noqa: E402

def add_requests(engine: LLMEngine, n: int, start: int, rng: random.Random) -> None:
    params = SamplingParams(max_tokens=1024, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(start, start + n):
        engine.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(128)], params)


def until_decode_only(engine: LLMEngine) -> None:
    while engine.scheduler.num_waiting or any(
            engine.scheduler.sequence(s).remaining > 1 for s in list(engine._by_seq)):
        engine.step()


def measure(engine: LLMEngine, batch: int, steps: int = 24) -> dict:
    torch.cuda.synchronize()
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    engine_ms = 1e3 * (time.perf_counter() - t0) / steps

    g = engine.runner.graphs
    bs = g.batch_for(batch)
    graph = g._graphs[bs][0]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_ms = start.elapsed_time(end) / steps

    fb = g.buffers.forward_batch(bs, g.max_context)
    # Under overlap scheduling (the CUDA default) the buffers hold future_ref ids: resolve them as the graph does.
    fb = dataclasses.replace(fb, input_ids=resolve_future_ids(fb.input_ids, engine.runner.last_ids))
    model, kv = engine.runner.model, engine.kv
    kernels = kernel_table(lambda: model.forward(fb, kv), torch.device("cuda"))
    ctx = sum(engine.scheduler.sequence(s).num_computed for s in engine._by_seq) / max(1, len(engine._by_seq))
    return {"batch": batch, "graph_batch": bs, "mean_context": round(ctx, 1), "engine_ms": round(engine_ms, 3),
            "replay_ms": round(replay_ms, 3), "host_gap_ms": round(engine_ms - replay_ms, 3),
            "eager_kernel_ms_by_category": kernels["ms_by_category"], "eager_kernel_ms_total": kernels["ms_total"],
            "top_kernels": kernels["top_kernels"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-2-7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    cfg = EngineConfig(model=a.model, device="cuda", dtype=a.dtype, kv_cache_memory_gb=40, max_running=256,
                       max_step_tokens=4096, max_prefill_chunk=2048)
    engine = LLMEngine(cfg)
    rng = random.Random(0)
    results = []
    add_requests(engine, 64, 0, rng)
    until_decode_only(engine)
    results.append(measure(engine, 64))
    add_requests(engine, 192, 64, rng)
    until_decode_only(engine)
    results.append(measure(engine, 256))
    for r in results:
        print(f"\n== batch {r['batch']} (graph {r['graph_batch']}, mean context {r['mean_context']}): engine "
              f"{r['engine_ms']} ms/step, replay {r['replay_ms']} ms, host gap {r['host_gap_ms']} ms; "
              f"eager kernels {r['eager_kernel_ms_total']} ms")
        print_kernel_table("eager kernels by category", {"ms_by_category": r["eager_kernel_ms_by_category"],
                                                         "top_kernels": r["top_kernels"]})
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "profile_decode.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
