"""Old vs new unseeded sampling: every row through the full sort (sample_batched, what the Sampler
did for every random row before sample_grouped) against sample_grouped. The sort path is the
old algorithm unchanged; only its CPU noise is the new vectorised one (identical on CUDA), so CPU
ratios here are lower than against the old code itself.

On an H200 a Llama-2 decode step at batch 64 took 8.7 ms with temperature 1.0 against 6.9 ms greedy
(24.0 vs 15.2 ms at 256): the old sampler sorts the whole vocabulary of every sampled row. This
times what the Sampler does for a batch of unseeded rows, host preparation included (the params
lists -> small device tensors), on logits quantised like a half-precision lm_head's:

  old: argmax, 4 param tensors, index_select, sort + softmax + cumsum + race over [B, V], index_copy
  new: sample_grouped (pure temperature: Gumbel-max; top-k: topk window; top-p only: the sort)

CUDA events on the GPU (the time between the first launch and the last kernel's end, so a host that
launches slower than the GPU runs shows up), perf_counter on the CPU. Prints the median per call.

    python perf/engine/bench_sampler.py [--batches 1,12,64,256] [--vocabs 32000,128256]
        [--modes temperature,top_k,top_p,mixed] [--reps N] [--device cuda|cpu] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvshare.runtime.sampler import sample_batched, sample_grouped
from kvshare.sampling_params import SamplingParams


def old_sampler(logits, params, generator):
    """The batched part of Sampler.__call__ as of commit 468b88c."""
    out = logits.argmax(dim=-1)
    batched = [i for i, p in enumerate(params) if not p.greedy]
    idx = torch.tensor(batched, dtype=torch.long).to(logits.device, non_blocking=True)
    temp = torch.tensor([params[i].temperature for i in batched], dtype=torch.float32).to(logits.device)
    top_p = torch.tensor([params[i].top_p for i in batched], dtype=torch.float32).to(logits.device)
    top_k = torch.tensor([params[i].top_k for i in batched], dtype=torch.long).to(logits.device)
    drawn = sample_batched(logits.index_select(0, idx), temp, top_k, top_p, generator)
    return out.index_copy(0, idx, drawn)


MODES = {
    "temperature": [SamplingParams(temperature=1.0)],
    "top_k": [SamplingParams(temperature=1.0, top_k=50)],
    "top_p": [SamplingParams(temperature=1.0, top_p=0.9)],
    "mixed": [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=50),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, top_k=40, top_p=0.95)],
}


def time_ms(fn, reps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,12,64,256")
    ap.add_argument("--vocabs", default="32000,128256")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=None, help="timed calls per case (default 50 on CUDA, 3 on CPU)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    reps = args.reps or (50 if device.type == "cuda" else 3)
    warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device {name}, torch {torch.__version__}, median of {reps} calls after {warmup} warm-up")
    print(f"{'B':>4} {'V':>7} {'mode':<12} {'old ms':>9} {'new ms':>9} {'speed-up':>8}")
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            g = torch.Generator(device=device).manual_seed(batch)
            # Logits of a half-precision lm_head: their ties at the k-th value are what the window path counts.
            logits = (torch.randn(batch, vocab, device=device, generator=g) * 2.5).half().float()
            for mode in args.modes.split(","):
                kinds = MODES[mode]
                params = [kinds[i % len(kinds)] for i in range(batch)]
                old = time_ms(lambda x=logits, p=params: old_sampler(x, p, gen), reps, warmup, device)
                new = time_ms(lambda x=logits, p=params: sample_grouped(x, p, gen), reps, warmup, device)
                print(f"{batch:>4} {vocab:>7} {mode:<12} {old:>9.3f} {new:>9.3f} {old / new:>7.1f}x", flush=True)
                rows.append({"batch": batch, "vocab": vocab, "mode": mode, "old_ms": old, "new_ms": new,
                             "device": name})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
