"""How much 8-bit KV pages change a model's output: fp8_e4m3 and int8 against the model's own dtype.

    python -m perf.engine.kv_dtype_accuracy                      # SmolLM2-135M (embedded GGUF), CPU, fp32
    python -m perf.engine.kv_dtype_accuracy --model dummy:llama-2-7b --device cuda --dtype float16

For every kv_cache_dtype the same forward (kvshare's Llama over the paged pool, the Triton kernels on
CUDA, the torch reference on the CPU) runs

* greedy, free-running: N prompts x M new tokens from the prompt's prefill and M - 1 decode steps
  in one batch; ``identical tokens`` is the fraction of the N x M positions whose token equals the
  16/32-bit run's (a prompt that diverges early counts its later tokens as different), ``identical
  sequences`` the prompts whose M tokens all equal;
* teacher-forced: the same prompts fed the reference run's tokens, so that every position sees the
  same context; at each of the N x M positions the logits are compared with the reference's: top-1
  agreement, max and mean |logit difference|, KL(reference || quantized) of the softmax;
* perplexity over a text the project ships (tests/data/lighthouse.txt, a short story written for
  this, about 1,100 tokens, cut to --ppl-tokens), prefilled in chunks of --ppl-chunk tokens: each chunk attends to
  the earlier chunks' quantized pages (and its own, read back from the pool like every key).

Models without a tokenizer (dummy:<name>, random weights) get random prompt ids and a random
"text": their perplexity compares the dtypes with each other only.

Prints a markdown table; --json and --md write it. CPU output of 2026-12-01:
perf/results/kv-dtype/2026-12-01/ (docs/operate/tune.md).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvshare.runtime.forward_batch import build_forward_batch
from kvshare.runtime.kv_cache import KV_CACHE_DTYPES, KVCache, kv_storage_dtype, page_bytes
from kvshare.runtime.llama import LlamaModel
from kvshare.runtime.tokenizer import encode_prompt
from kvshare.runtime.weights import LoadedModel, load_model

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "tests/data/lighthouse.txt"
PAGE_SIZE = 16
# Plain and chat prompts of several kinds (facts, code, lists, a story): the reference text is the
# model's own greedy continuation, so these only need to lead somewhere different.
PROMPTS = [
    ("The capital of France is", False),
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("Here is a list of five fruits:\n1.", False),
    ("Once upon a time, in a small village by the sea, there lived", False),
    ("What is the boiling point of water at sea level?", True),
    ("Write a haiku about autumn leaves.", True),
    ("Explain in two sentences why the sky is blue.", True),
    ("Give me three tips for learning a new language.", True),
]


@dataclass(frozen=True)
class Row:
    kv_cache_dtype: str
    bytes_per_token: int             # pool bytes per token over all layers (K, V, scales)
    pages_per_gib: int               # pages of PAGE_SIZE tokens in 1 GiB
    identical_tokens: float          # free-running greedy, fraction of N x M
    identical_sequences: int         # of N
    top1_agreement: float            # teacher-forced, fraction of N x M
    max_abs_logit_err: float
    mean_abs_logit_err: float
    mean_kl: float
    max_kl: float
    perplexity: float
    ppl_tokens: int


class PagedRunner:
    """The model over a pool of one kv_cache_dtype; sequence i owns pages [i * per, (i + 1) * per)."""

    def __init__(self, loaded: LoadedModel, kv_cache_dtype: str, dtype: torch.dtype, device: torch.device,
                 rows: int, max_tokens: int):
        self.device = device
        self.per = -(-max_tokens // PAGE_SIZE)
        self.storage = kv_storage_dtype(kv_cache_dtype, dtype)
        self.kv = KVCache.allocate(loaded.config, num_pages=rows * self.per, page_size=PAGE_SIZE, dtype=self.storage,
                                   device=device)
        self.model = LlamaModel(loaded.config, loaded.weights, device=device, dtype=dtype)

    def pages(self, row: int) -> list[int]:
        return list(range(row * self.per, (row + 1) * self.per))

    def forward(self, chunks, all_logits=None) -> torch.Tensor:
        batch = build_forward_batch(chunks, PAGE_SIZE, self.device, all_logits=all_logits)
        return self.model.forward(batch, self.kv).float()

    def greedy(self, prompts: list[list[int]], new_tokens: int, forced: torch.Tensor | None = None):
        """(tokens [N, M], logits [N, M, V] on the CPU); forced [N, M]: feed these tokens instead."""
        n = len(prompts)
        logits = self.forward([(p, 0, self.pages(i), True) for i, p in enumerate(prompts)])
        steps, toks = [logits.cpu()], []
        for j in range(new_tokens):
            tok = (forced[:, j] if forced is not None else steps[-1].argmax(-1)).tolist()
            toks.append(tok)
            if j == new_tokens - 1:
                break
            chunks = [([tok[i]], len(prompts[i]) + j, self.pages(i), True) for i in range(n)]
            steps.append(self.forward(chunks).cpu())
        return torch.tensor(toks).t(), torch.stack(steps, dim=1)

    def perplexity(self, ids: list[int], chunk: int) -> float:
        nll, count = 0.0, 0
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start: start + chunk]
            logits = self.forward([(piece, start, self.pages(0), True)], all_logits=[True])
            targets = torch.tensor(ids[start + 1: start + 1 + len(piece)], device=logits.device)
            lp = torch.log_softmax(logits[: len(targets)], dim=-1)
            nll -= float(lp.gather(1, targets[:, None]).sum())
            count += len(targets)
        return math.exp(nll / count)


def prompt_ids(loaded: LoadedModel, n: int) -> list[list[int]]:
    if loaded.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, loaded.config.vocab_size, (12 + 5 * i,), generator=g).tolist() for i in range(n)]
    return [encode_prompt(loaded.tokenizer, text, chat=chat) for text, chat in (PROMPTS * n)[:n]]


def text_ids(loaded: LoadedModel, max_tokens: int) -> list[int]:
    if loaded.tokenizer is None:
        g = torch.Generator().manual_seed(1)
        return torch.randint(3, loaded.config.vocab_size, (max_tokens,), generator=g).tolist()
    return list(loaded.tokenizer.encode(TEXT.read_text(), add_special_tokens=True))[:max_tokens]


def compare(ref_logits: torch.Tensor, logits: torch.Tensor) -> dict:
    diff = (logits - ref_logits).abs()
    lp_ref = torch.log_softmax(ref_logits.double(), -1)
    lp = torch.log_softmax(logits.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    return dict(top1_agreement=float((logits.argmax(-1) == ref_logits.argmax(-1)).double().mean()),
                max_abs_logit_err=float(diff.max()), mean_abs_logit_err=float(diff.mean()),
                mean_kl=float(kl.mean()), max_kl=float(kl.max()))


def measure(loaded: LoadedModel, args, dtype: torch.dtype, device: torch.device) -> list[Row]:
    prompts = prompt_ids(loaded, args.prompts)
    ppl_ids = text_ids(loaded, args.ppl_tokens)
    longest = max(max(len(p) for p in prompts) + args.tokens, len(ppl_ids))
    rows, ref = [], None
    for name in ["auto"] + [d for d in args.kv_dtypes if d != "auto"]:
        t0 = time.perf_counter()
        runner = PagedRunner(loaded, name, dtype, device, len(prompts), longest)
        free_toks, free_logits = runner.greedy(prompts, args.tokens)
        if ref is None:
            ref = (free_toks, free_logits)
            forced_logits = free_logits
        else:
            _, forced_logits = runner.greedy(prompts, args.tokens, forced=ref[0])
        ppl = runner.perplexity(ppl_ids, args.ppl_chunk)
        same = free_toks == ref[0]
        row = Row(name, runner.kv.bytes_per_token,
                  (1 << 30) // page_bytes(loaded.config, page_size=PAGE_SIZE, dtype=runner.storage),
                  float(same.double().mean()), int(same.all(dim=1).sum()), **compare(ref[1], forced_logits),
                  perplexity=ppl, ppl_tokens=len(ppl_ids))
        rows.append(row)
        print(f"   {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        del runner
    return rows


def markdown(rows: list[Row], n: int, m: int) -> str:
    base = rows[0].perplexity
    head = ("| kv_cache_dtype | bytes/token | pages/GiB | identical greedy tokens | identical sequences | "
            "top-1 agreement (forced) | max abs logit err | mean abs logit err | mean KL | max KL | perplexity | "
            "vs auto |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r.kv_cache_dtype} | {r.bytes_per_token:,} | {r.pages_per_gib:,} | "
                     f"{r.identical_tokens:.4f} ({round(r.identical_tokens * n * m)}/{n * m}) | "
                     f"{r.identical_sequences}/{n} | {r.top1_agreement:.4f} | {r.max_abs_logit_err:.4f} | "
                     f"{r.mean_abs_logit_err:.5f} | {r.mean_kl:.2e} | {r.max_kl:.2e} | {r.perplexity:.4f} | "
                     f"{(r.perplexity / base - 1) * 100:+.2f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help=".gguf, HF dir or dummy:<name>; default SmolLM2-135M")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="the model's (and auto pages') dtype; default float32 on CPU, "
                                                  "float16 on CUDA")
    ap.add_argument("--kv-dtypes", default="auto,fp8_e4m3,int8")
    ap.add_argument("--prompts", type=int, default=8, help="N prompts")
    ap.add_argument("--tokens", type=int, default=32, help="M greedy tokens per prompt")
    ap.add_argument("--ppl-tokens", type=int, default=1024, help="text tokens for the perplexity")
    ap.add_argument("--ppl-chunk", type=int, default=128, help="prefill chunk of the perplexity pass")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    args = ap.parse_args(argv)
    args.kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    for d in args.kv_dtypes:
        if d not in KV_CACHE_DTYPES:
            ap.error(f"--kv-dtypes: {d} is not one of {', '.join(KV_CACHE_DTYPES)}")
    device = torch.device(args.device)
    args.dtype = args.dtype or ("float16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False     # the reference run stays the model's own arithmetic
    loaded = load_model(args.model, dtype=dtype, device=device)
    print(f"model {Path(loaded.source).name} {args.dtype} on {args.device}; {args.prompts} prompts x {args.tokens} tokens; "
          f"page size {PAGE_SIZE}", flush=True)
    t0 = time.perf_counter()
    rows = measure(loaded, args, dtype, device)
    table = markdown(rows, args.prompts, args.tokens)
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    footer = (f"\n{Path(loaded.source).name} {args.dtype} on {dev} (torch {torch.__version__}); {args.prompts} prompts "
              f"x {args.tokens} greedy tokens; perplexity over {rows[0].ppl_tokens} tokens of "
              f"{TEXT.relative_to(ROOT) if loaded.tokenizer is not None else 'random ids'} in chunks of "
              f"{args.ppl_chunk}; {time.perf_counter() - t0:.0f} s\n")
    print("\n" + table + footer, flush=True)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(table + footer)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(model=Path(loaded.source).name, dtype=args.dtype, device=args.device,
                                             prompts=args.prompts, tokens=args.tokens, ppl_chunk=args.ppl_chunk,
                                             rows=[asdict(r) for r in rows]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
