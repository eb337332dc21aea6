"""Where shared-prefix decode and mixed steps spend their time on the GPU (the two open questions of
docs/results/h200.md).

Builds the shared-prefix steady state in one engine (Llama-2-7B shape, fp16, random weights, page 16):
G groups x M requests, each a group's 2048-token system prompt + its own 128-token question, the
system prompts computed once (the group leaders first), then decoded until every row is decode-only.
Then, at that batch:
  - engine ms/step and the runner's path (cascade-graph expected),
  - replay ms of the cascade graph and of the plain graph over the same inputs (what cascade saves),
  - per-kernel CUDA time of one eager forward with the same cascade plan (torch.profiler, grouped:
    prefix / suffix / merge / GEMMs / ...),
  - one mixed step: P new 128-token prompts joining the decode rows (eager; kernels grouped the same way).

    python perf/engine/profile_shared_prefix.py [--groups 16] [--members 16] [--new 16] [--out DIR]
    python perf/engine/profile_shared_prefix.py --dry-run   # CPU, tiny model: checks the script
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
import sys
from collections import defaultdict
from pathlib import Path

import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.runtime.cuda_graph_runner import resolve_future_ids
from kvshare.sampling_params import SamplingParams

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.engine.kernel_profile import host_profile, kernel_table, print_host_profile, print_kernel_table, save_json, sync  # noqa: E402

def build_steady_state(engine: LLMEngine, groups: int, members: int, system_len: int, question_len: int,
                       rng: random.Random) -> None:
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=4 * question_len, temperature=0.0, ignore_eos=True)
    systems = [[rng.randrange(3, vocab) for _ in range(system_len)] for _ in range(groups)]

    def prompt(g: int) -> list[int]:
        return systems[g] + [rng.randrange(3, vocab) for _ in range(question_len)]

    for g in range(groups):                         # leaders: each system prompt computed once
        engine.add_request(f"g{g}-0", prompt(g), params)
    while engine.scheduler.num_waiting or any(engine.scheduler.sequence(s).remaining > 1 for s in list(engine._by_seq)):
        engine.step()
    for g in range(groups):
        for m in range(1, members):
            engine.add_request(f"g{g}-{m}", prompt(g), params)
    while engine.scheduler.num_waiting or any(engine.scheduler.sequence(s).remaining > 1 for s in list(engine._by_seq)):
        engine.step()


def timed(fn, device: torch.device, reps: int) -> float:
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return 1e3 * (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-2-7b")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--members", type=int, default=16)
    ap.add_argument("--new", type=int, default=16, help="128-token prompts joining in the mixed step")
    ap.add_argument("--kv-gb", type=float, default=100.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, small shapes: checks the script")
    a = ap.parse_args()
    if a.dry_run:
        cfg = EngineConfig(model="dummy:tiny-llama", device="cpu", dtype="float32", page_size=4, num_pages=512,
                           max_running=64, max_step_tokens=512, max_prefill_chunk=256)
        system_len, question_len, a.groups, a.members, a.new = 16, 4, 2, 4, 2
    else:
        cfg = EngineConfig(model=a.model, device="cuda", dtype="float16", kv_cache_memory_gb=a.kv_gb,
                           max_running=256, max_step_tokens=4096, max_prefill_chunk=2048)
        system_len, question_len = 2048, 128
    engine = LLMEngine(cfg)
    device = engine.device
    rng = random.Random(0)
    t0 = time.perf_counter()
    build_steady_state(engine, a.groups, a.members, system_len, question_len, rng)
    rows = len(engine._by_seq)
    result: dict = {"groups": a.groups, "members": a.members, "rows": rows, "setup_s": round(time.perf_counter() - t0, 1)}

    paths: dict[str, int] = defaultdict(int)

    def one_step() -> None:
        engine.step()
        paths[engine.runner.last_path] += 1

    result["engine_ms_per_step"] = round(timed(one_step, device, 12), 3)
    result["paths"] = dict(paths)
    result["host_profile"] = host_profile(engine.step, 8)
    g = engine.runner.graphs
    if g is not None:
        bs = g.batch_for(rows)
        result["graph_batch"] = bs
        for name, table in (("cascade_graph", g._cascade_graphs), ("plain_graph", g._graphs)):
            if bs in table:
                result[f"{name}_replay_ms"] = round(timed(table[bs][0].replay, device, 12), 3)
        if g.cascade_plans is not None and g.cascade_plans.covers(bs):
            fb = g.buffers.forward_batch(bs, g.max_context)
            # Under overlap scheduling the buffers hold future_ref ids (-1 - row): resolve them as the graph does.
            fb = dataclasses.replace(fb, cascade=g.cascade_plans.plan(bs),
                                     input_ids=resolve_future_ids(fb.input_ids, engine.runner.last_ids))
            plan = g.cascade_plans.plan(bs)
            result["plan"] = {"groups_in_graph": plan.num_groups, "prefix_splits": plan.prefix_splits,
                              "live_groups": int((plan.group_shared_len > 0).sum()),
                              "shared_tokens_per_row": plan.row_shared_len[:rows].float().mean().item()}
            result["eager_cascade_forward"] = kernel_table(lambda: engine.runner.model.forward(fb, engine.kv), device)

    vocab = engine.model_config.vocab_size
    for i in range(a.new):
        engine.add_request(f"new{i}", [rng.randrange(3, vocab) for _ in range(question_len)],
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    result["mixed_step"] = kernel_table(engine.step, device, reps=1, warm=False)
    result["mixed_step"]["shape"] = dataclasses.asdict(engine.last_step)

    print(json.dumps({k: v for k, v in result.items() if k not in ("eager_cascade_forward", "mixed_step", "host_profile")},
                     indent=1))
    print_host_profile("engine.step at the steady state", result["host_profile"])
    for key in ("eager_cascade_forward", "mixed_step"):
        if key in result:
            r = result[key]
            print_kernel_table(f"{key}: {r['ms_total']} ms {r.get('shape', '')}", r, top=12)
    save_json(a.out, "profile_shared_prefix.json", result)


if __name__ == "__main__":
    main()
