"""Tensor parallelism vs one rank: the same prompts, greedy, through LLMEngine with
tensor_parallel_size 1 and N; prints the first generated position's logits difference, the greedy
tokens' agreement, and (with --time) the decode step time and tok/s of both.

    python perf/engine/check_tensor_parallel.py --model dummy:llama-2-7b --device cuda --dtype bfloat16 --tp 2 --time
    python perf/engine/check_tensor_parallel.py --model dummy:tiny-llama --device cpu --tp 2    # gloo, a smoke run

Pass (exit 0) when every prompt's first-position logits agree within --rtol of the logits' range
(max |TP - 1| <= rtol * (max - min)) and the first generated token is the same; in fp32 the greedy
tokens must be identical over --tokens too. A bf16 all-reduce sums partial products in another
order than one GEMM, so later greedy tokens may part where two logits nearly tie: reported, not failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.sampling_params import SamplingParams


def generate(engine: LLMEngine, prompts: list[list[int]], tokens: int, logits: bool) -> tuple[list, list]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, return_generation_logits=logits)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    out_ids = {f"p{i}": [] for i in range(len(prompts))}
    first = {}
    while engine.has_work:
        for o in engine.step():
            out_ids[o.request_id] += o.token_ids
            if logits and o.generation_logits and o.request_id not in first:
                first[o.request_id] = o.generation_logits[0].float()
    keys = [f"p{i}" for i in range(len(prompts))]
    return [out_ids[k] for k in keys], [first.get(k) for k in keys]


def timed_decode(engine: LLMEngine, batch: int, prompt_len: int, tokens: int, vocab: int) -> dict:
    """batch requests decoding together: seconds per decode-only step and output tok/s."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"t{i}", [(31 * i + j) % vocab for j in range(prompt_len)], params)
    decode_s, decode_steps, out = 0.0, 0, 0
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    while engine.has_work:
        t = time.perf_counter()
        outs = engine.step()
        sync()
        if engine.last_step.prefill_tokens == 0 and engine.last_step.decode_rows == batch:
            decode_s += time.perf_counter() - t
            decode_steps += 1
        out += sum(len(o.token_ids) for o in outs)
    secs = time.perf_counter() - start
    return {"batch": batch, "decode_step_ms": round(1e3 * decode_s / max(decode_steps, 1), 3),
            "tok_s": round(out / secs, 1), "seconds": round(secs, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-2-7b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rtol", type=float, default=0.02, help="of the logits' range (bf16: ~3 significant digits)")
    ap.add_argument("--kv-gb", type=float, default=None, help="default 20 on CUDA, 0.05 on the CPU")
    ap.add_argument("--time", action="store_true", help="also time decode at --batches")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    kv_gb = args.kv_gb or (20.0 if cuda else 0.05)
    base = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, kv_cache_memory_gb=kv_gb, max_running=64)
    report: dict = {"model": args.model, "dtype": args.dtype, "tp": args.tp}
    engines = {}
    results = {}
    for tp in (1, args.tp):
        engine = LLMEngine(EngineConfig(**{**base.__dict__, "tensor_parallel_size": tp,
                                           # the same eager path on both sides: TP runs without graphs (for now)
                                           "cuda_graphs": False, "overlap_schedule": False}))
        vocab = engine.model_config.vocab_size
        prompts = [[(17 * i + 5 * j) % vocab for j in range(24 + 8 * i)] for i in range(args.prompts)]
        results[tp] = generate(engine, prompts, args.tokens, logits=True)
        if args.time:
            report[f"tp{tp}_decode"] = [timed_decode(engine, int(b), 128, 32, vocab) for b in args.batches.split(",")]
        engine.close()
        engines[tp] = None
        del engine
    (ids1, logits1), (ids2, logits2) = results[1], results[args.tp]
    ok = True
    rows = []
    for i, (a, b) in enumerate(zip(logits1, logits2)):
        span = float(a.max() - a.min())
        diff = float((a - b).abs().max())
        same_first = ids1[i][:1] == ids2[i][:1]
        agree = sum(x == y for x, y in zip(ids1[i], ids2[i])) / len(ids1[i])
        within = diff <= args.rtol * span
        ok &= within and same_first and (args.dtype != "float32" or ids1[i] == ids2[i])
        rows.append({"prompt": i, "max_abs_diff": round(diff, 5), "logit_range": round(span, 3), "within": within,
                     "same_first_token": same_first, "greedy_agreement": round(agree, 3)})
        print(f"prompt {i}: max |logits TP{args.tp} - TP1| {diff:.5f} of range {span:.3f} ({'ok' if within else 'OUT'}), "
              f"first token {'same' if same_first else 'DIFFERS'}, greedy agreement {agree:.0%}")
    report["prompts"] = rows
    report["pass"] = ok
    for key in ("tp1_decode", f"tp{args.tp}_decode"):
        for r in report.get(key, []):
            print(f"{key}: batch {r['batch']}: decode step {r['decode_step_ms']} ms, {r['tok_s']:,.1f} tok/s")
    print("PASS" if ok else "FAIL")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
