"""Where fixed-256's prefill phase spends its time on the GPU (docs/results/h200.md: 9 eager
prefill/mixed steps take 0.76 s of its 2.5 s).

One engine (Llama-2-7B shape, fp16, random weights, page 16, the offline benchmark's defaults):
N requests of P random tokens arrive at once; the prefill phase is every step until all of them
decode. It runs once to warm up (compiles, allocator) and drains, then again:
  - per step: its shape, host ms (step() returning) and wall ms (to a device sync after it),
  - the phase's CUDA time by kernel category (torch.profiler), against the GEMM FLOPs it did.

    python perf/engine/profile_prefill.py [--requests 256] [--prompt 128] [--out DIR]
    python perf/engine/profile_prefill.py --dry-run   # CPU, tiny model: checks the script
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.sampling_params import SamplingParams

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.engine.kernel_profile import host_profile, kernel_table, print_host_profile, print_kernel_table, save_json, sync  # noqa: E402


def in_prefill_phase(engine: LLMEngine) -> bool:
    s = engine.scheduler
    return bool(s.num_waiting) or any(s.sequence(sid).remaining > 1 for sid in list(engine._by_seq))


def add_requests(engine: LLMEngine, tag: str, n: int, prompt_len: int, out_len: int, rng: random.Random) -> None:
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"{tag}{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)], params)


def drain(engine: LLMEngine) -> None:
    while engine.has_work:
        engine.step()


def timed_phase(engine: LLMEngine, device) -> list[dict]:
    steps = []
    while in_prefill_phase(engine):
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        steps.append({**dataclasses.asdict(engine.last_step), "host_ms": round(1e3 * (t1 - t0), 2),
                      "wall_ms": round(1e3 * (t2 - t0), 2)})
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-2-7b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--max-step-tokens", type=int, default=4096)
    ap.add_argument("--kv-gb", type=float, default=40.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, small shapes: checks the script")
    a = ap.parse_args()
    if a.dry_run:
        cfg = EngineConfig(model="dummy:tiny-llama", device="cpu", dtype="float32", page_size=4, num_pages=1024,
                           max_running=16, max_step_tokens=64, max_prefill_chunk=64)
        a.requests, a.prompt, a.out_len = 16, 12, 4
    else:
        cfg = EngineConfig(model=a.model, device="cuda", dtype="float16", kv_cache_memory_gb=a.kv_gb,
                           max_running=a.requests, max_step_tokens=a.max_step_tokens, max_prefill_chunk=2048)
    engine = LLMEngine(cfg)
    device = engine.device
    rng = random.Random(0)
    add_requests(engine, "warm", a.requests, a.prompt, a.out_len, rng)
    drain(engine)

    add_requests(engine, "timed", a.requests, a.prompt, a.out_len, rng)
    steps = timed_phase(engine, device)
    drain(engine)

    add_requests(engine, "prof", a.requests, a.prompt, a.out_len, rng)
    table = kernel_table(lambda: [engine.step() for _ in range(len(steps))], device, reps=1, warm=False)
    drain(engine)

    # the phase again, unsynchronised as the benchmarks run it: wall time and where the host spends it
    add_requests(engine, "free", a.requests, a.prompt, a.out_len, rng)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(len(steps)):
        engine.step()
    sync(device)
    free_ms = 1e3 * (time.perf_counter() - t0)
    drain(engine)
    add_requests(engine, "host", a.requests, a.prompt, a.out_len, rng)
    host = host_profile(lambda: [engine.step() for _ in range(len(steps))], 1)
    drain(engine)

    c = engine.model_config
    w = engine.runner.model.weights
    layer_params = sum(t.numel() for lw in w.layers for t in (lw.qkv, lw.o_proj, lw.gate_up, lw.down))
    tokens = sum(s["prefill_tokens"] + s["decode_rows"] for s in steps)
    gemm_ms = table["ms_by_category"].get("gemm", 0.0)
    result = {"requests": a.requests, "prompt": a.prompt, "steps": steps,
              "phase_wall_ms": round(sum(s["wall_ms"] for s in steps), 1),
              "phase_host_ms": round(sum(s["host_ms"] for s in steps), 1),
              "phase_unsynced_ms": round(free_ms, 1),
              "tokens": tokens, "hidden": c.hidden_size, "layers": c.num_layers, "layer_gemm_params": layer_params,
              "kernels": table, "host_profile": host}
    if gemm_ms:   # the layers' GEMMs only (lm_head runs on the sampled rows, a few per cent)
        result["layer_gemm_tflops"] = round(2 * layer_params * tokens / (gemm_ms / 1e3) / 1e12, 1)
    print(json.dumps({k: v for k, v in result.items() if k not in ("kernels", "steps", "host_profile")}, indent=1))
    for s in steps:
        print(f"   step decode={s['decode_rows']:4d} prefill={s['prefill_tokens']:5d} {s['path']:13s} "
              f"host {s['host_ms']:8.2f} ms  wall {s['wall_ms']:8.2f} ms")
    print_host_profile("the prefill phase's steps, unsynchronised", host)
    print_kernel_table(f"prefill phase ({len(steps)} steps): {table['ms_total']} ms CUDA", table, top=15)
    save_json(a.out, "profile_prefill.json", result)


if __name__ == "__main__":
    main()
