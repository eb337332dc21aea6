"""The CPU default's decode step beside HF transformers', in one run.

    python -m perf.engine.cpu_decode_step [--batch 12] [--prompt-tokens 128] [--rounds 6] [--out DIR]

Two tables, each timed as interleaved rounds (min over rounds: this 2-core machine's speed drifts
by tens of percent between minutes):

1. Every GEMM shape of the model at decode and prefill row counts: `F.linear` (what HF runs)
   against `onednn_linear` (runtime/cpu_linear.py, fp32 weights) and the block kernel over the
   GGUF's own blocks (kvshare_kernels.block_linear, the engine's default; Q4_1 random codes, and
   the lm_head in Q8_0 as SmolLM2's file holds it). The GEMM weights are random and repeated, so
   a small one stays in cache: the step below is what a model's 538 MB of fp32 weights meets.
2. One decode step of `--batch` sequences at `--prompt-tokens` of context: LLMEngine.step() with
   F.linear (KVSHARE_CPU_LINEAR=0), with oneDNN (cpu_weights=fp32) and with the GGUF's blocks
   (cpu_weights=blocks), against HF's forward of one token per sequence over its KV cache plus the
   greedy pick, i.e. one step of `generate`.
3. Where that step goes (torch.profiler, self CPU time of --steps steps per contender, by kind
   of op): the linear layers, the attention's own kernel, gathering the KV pages (index_select)
   and everything else; and the bandwidth the linear layers reach over the weights they read.

The model is the embedded default (SmolLM2-135M-Instruct, fp32) unless --model names another.
Writes cpu_decode_step.json under --out when given.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.engine.offline_benchmark import hf_model  # noqa: E402

from kvshare.engine.engine import LLMEngine  # noqa: E402
from kvshare.engine.engine_config import EngineConfig  # noqa: E402
from kvshare.runtime.cpu_linear import onednn_linear  # noqa: E402
from kvshare.runtime.weights import LoadedModel, load_model  # noqa: E402
from kvshare_kernels import block_linear as bl  # noqa: E402
from kvshare.sampling_params import SamplingParams  # noqa: E402


def _min_time(fns: dict[str, Callable[[], object]], rounds: int, repeat: int) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / repeat)
    return best


def _linear_weights(loaded: LoadedModel) -> list[torch.Tensor]:
    """The weights a decode step multiplies by: every layer's linear layers and the lm_head."""
    w = loaded.weights
    return [t for layer in w.layers for t in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)] + [w.lm_head]


def gemm_table(loaded: LoadedModel, rows: list[int], rounds: int) -> list[dict]:
    c = loaded.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"qkv": (q + 2 * kv, c.hidden_size), "o_proj": (c.hidden_size, q),
              "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
              "lm_head": (c.vocab_size, c.hidden_size)}
    out = []
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        blocks = None
        if bl.available() and bl.packable(n, k):
            d = (torch.rand(n, k // 32, generator=g) * 0.01).half()
            blocks = bl.pack_q8_0(torch.randint(-128, 128, (n, k), generator=g), d) if name == "lm_head" else \
                bl.pack_q4_1(torch.randint(0, 16, (n, k), generator=g), d, -d * 8)
        w = bl.dequantize(blocks) if blocks is not None else torch.randn(n, k)
        for m in rows:
            x = torch.randn(m, k)
            repeat = max(1, int(2e8 // (n * k * 4)))
            fns = {"F.linear": lambda: F.linear(x, w), "oneDNN": lambda: onednn_linear(x, w)}
            if blocks is not None:
                fns["blocks"] = lambda: bl.block_linear(x, blocks)
            t = _min_time(fns, rounds, repeat)
            row = {"layer": name, "n": n, "k": k, "rows": m, "f_linear_ms": t["F.linear"] * 1e3,
                   "onednn_ms": t["oneDNN"] * 1e3, "speedup": t["F.linear"] / t["oneDNN"]}
            if blocks is not None:
                row |= {"format": blocks.format, "blocks_ms": t["blocks"] * 1e3, "blocks_speedup": t["F.linear"] / t["blocks"]}
            out.append(row)
            tail = f"   blocks ({blocks.format}) {t['blocks'] * 1e3:8.3f} ms {row['blocks_speedup']:.2f}x" if blocks else ""
            print(f"  {name:8s} [{n:6d} x {k:5d}] rows {m:4d}: F.linear {t['F.linear'] * 1e3:8.3f} ms   "
                  f"oneDNN {t['oneDNN'] * 1e3:8.3f} ms   {row['speedup']:.2f}x{tail}", flush=True)
    return out


# op name -> kind; the first pattern contained in the name wins
OP_KINDS = (("linear", ("block_linear", "_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "aten::matmul")),
            # bmm: the reference attention's math path (scores and values), not a linear layer; paged_decode_attention: the native CPU op
            ("attention", ("scaled_dot_product", "flash_attention", "aten::bmm", "paged_decode_attention")),
            ("kv gather", ("aten::index_select", "aten::index_fill_", "aten::cat")))


def op_kind(name: str) -> str:
    for kind, patterns in OP_KINDS:
        if any(p in name for p in patterns):
            return kind
    return "other"


def step_breakdown(fn: Callable[[], object], steps: int) -> dict[str, float]:
    """Self CPU ms per step by op kind (OP_KINDS), over `steps` calls of fn under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    kinds = {kind: 0.0 for kind, _ in OP_KINDS} | {"other": 0.0}
    for event in prof.key_averages():
        kinds[op_kind(event.key)] += event.self_cpu_time_total / 1e3 / steps
    return kinds


class EngineDecode:
    """An engine holding `batch` sequences in decode: each call is one engine step."""

    def __init__(self, loaded: LoadedModel, batch: int, prompts: list[list[int]], cpu_linear: bool):
        os.environ["KVSHARE_CPU_LINEAR"] = "1" if cpu_linear else "0"
        try:
            blocks = isinstance(loaded.weights.lm_head, bl.BlockWeight)
            cfg = EngineConfig(model=loaded.source, device="cpu", dtype="float32", kv_cache_memory_gb=0.25,
                               max_running=batch, overlap_schedule=False, enable_prefix_caching=False,
                               cpu_weights="blocks" if blocks else "fp32")
            self.engine = LLMEngine(cfg, loaded=loaded)
        finally:
            os.environ.pop("KVSHARE_CPU_LINEAR", None)
        for i, p in enumerate(prompts):
            self.engine.add_request(f"r{i}", p, SamplingParams(max_tokens=2048, temperature=0.0, ignore_eos=True))
        while self.engine.last_step is None or self.engine.last_step.prefill_tokens:
            self.engine.step()

    def __call__(self) -> None:
        self.engine.step()


class HfDecode:
    """HF's model over its own KV cache: each call is one token per sequence and the greedy pick."""

    def __init__(self, model, prompts: list[list[int]]):
        self.model = model
        with torch.inference_mode():
            out = model(input_ids=torch.tensor(prompts), use_cache=True)
        self.cache, self.next_ids = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def __call__(self) -> None:
        out = self.model(input_ids=self.next_ids, past_key_values=self.cache, use_cache=True)
        self.cache, self.next_ids = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=".gguf, HF dir or dummy:<name>; default SmolLM2-135M")
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4, help="decode steps per round and contender")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    loaded = load_model(args.model, dtype=torch.float32, device="cpu")
    c = loaded.config
    print(f"1. GEMMs of {loaded.source}, min of {args.rounds} interleaved rounds", flush=True)
    gemms = gemm_table(loaded, sorted({1, args.batch, 64, args.batch * args.prompt_tokens}), args.rounds)

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, c.vocab_size, (args.batch, args.prompt_tokens), generator=g).tolist()
    print(f"2. one decode step, {args.batch} sequences at {args.prompt_tokens}+ tokens of context", flush=True)
    contenders = {"engine, F.linear": EngineDecode(loaded, args.batch, prompts, cpu_linear=False),
                  "engine, oneDNN": EngineDecode(loaded, args.batch, prompts, cpu_linear=True),
                  "HF forward + argmax": HfDecode(hf_model(loaded, argparse.Namespace(dtype="float32", device="cpu")),
                                                  prompts)}
    blocks = load_model(args.model, dtype=torch.float32, device="cpu", cpu_blocks=True)
    if isinstance(blocks.weights.lm_head, bl.BlockWeight):
        contenders = {"engine, GGUF blocks": EngineDecode(blocks, args.batch, prompts, cpu_linear=True)} | contenders
    else:
        print("  (no GGUF blocks here: the model is not a GGUF, or the block kernel does not run)", flush=True)
    step = _min_time(contenders, args.rounds, args.steps)
    hf = step["HF forward + argmax"]
    for name, s in step.items():
        print(f"  {name:22s} {s * 1e3:8.1f} ms/step   {hf / s:.2f}x HF", flush=True)
    weight_gb = sum(t.numel() * t.element_size() for t in _linear_weights(loaded)) / 1e9
    block_gb = sum(w.nbytes for w in _linear_weights(blocks) if isinstance(w, bl.BlockWeight)) / 1e9
    print(f"3. where a step goes (torch.profiler, self CPU ms per step; {weight_gb * 1e3:.0f} MB of linear "
          f"weights read per step)", flush=True)
    kinds = {name: step_breakdown(fn, args.steps) for name, fn in contenders.items()}
    print(f"  {'':22s} " + " ".join(f"{k:>10s}" for k in next(iter(kinds.values()))) + "   linear GB/s", flush=True)
    for name, row in kinds.items():
        gb = block_gb if name == "engine, GGUF blocks" else weight_gb
        print(f"  {name:22s} " + " ".join(f"{v:10.1f}" for v in row.values())
              + f"   {gb / (row['linear'] / 1e3):8.1f}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu_decode_step.json").write_text(json.dumps(
            {"model": loaded.source, "batch": args.batch, "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
             "threads": torch.get_num_threads(), "gemms": gemms,
             "decode_step_ms": {k: v * 1e3 for k, v in step.items()},
             "step_breakdown_ms": kinds, "linear_weight_gb": weight_gb, "block_weight_gb": block_gb}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
