"""kvshare's forward (paged Triton kernels) against HF transformers' LlamaForCausalLM on the same
weights: fp32 with TF32 off must agree to fp32 rounding; bf16's relative error is reported.

    python perf/engine/check_forward_parity.py [--device cuda]

Weights are random (SmolLM2-135M and Llama-3-8B-like GQA shapes, fewer layers); prompts are a ragged
batch run as chunked prefill plus decode steps through the paged cache, exactly as the engine does.
"""
from __future__ import annotations

import argparse
import sys

import torch

from kvshare.runtime.forward_batch import build_forward_batch
from kvshare.runtime.kv_cache import KVCache
from kvshare.runtime.llama import LlamaModel
from kvshare.runtime.weights import _from_hf_model

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, num_hidden_layers=6, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama3-gqa": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=128, num_hidden_layers=4, vocab_size=32000, rope_theta=500000.0, tie_word_embeddings=False),
}


def check(shape: str, dtype: torch.dtype, device: str, page_size: int = 16) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(max_position_embeddings=2048, rms_norm_eps=1e-5, **SHAPES[shape])
    hf = LlamaForCausalLM(cfg).to(device=device, dtype=torch.float32).eval()
    for p in hf.parameters():          # HF init is tiny; widen it so attention is not uniform
        p.data.normal_(0, 0.05)
    config, weights = _from_hf_model(hf, dtype, torch.device(device))
    model = LlamaModel(config, weights, device=torch.device(device), dtype=dtype)
    lens = [37, 5, 64, 18]
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in lens]
    num_pages = sum(-(-(n + 8) // page_size) for n in lens) + 4
    dev = torch.device(device)
    kv = KVCache.allocate(config, num_pages=num_pages, page_size=page_size, dtype=dtype, device=dev)
    perm = torch.randperm(num_pages).tolist()       # pages out of order, as a real pool hands them out
    tables, cursor = [], 0
    for n in lens:
        k = -(-(n + 8) // page_size)
        tables.append(perm[cursor:cursor + k])
        cursor += k
    worst = 0.0
    seqs = [list(p) for p in prompts]
    # Step 1: prefill in two chunks each (the second chunk attends to the first through the pages).
    half = [n // 2 for n in lens]
    batch = build_forward_batch([(p[:h], 0, t, False) for p, h, t in zip(prompts, half, tables)], page_size, dev)
    model.forward(batch, kv)
    batch = build_forward_batch([(p[h:], h, t, True) for p, h, t in zip(prompts, half, tables)], page_size, dev)
    for step in range(4):
        logits = model.forward(batch, kv)
        with torch.inference_mode():
            ref = torch.stack([hf(torch.tensor([s], device=device)).logits[0, -1].float() for s in seqs])
        err = ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        worst = max(worst, err)
        nxt = ref.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        batch = build_forward_batch([([s[-1]], len(s) - 1, t, True) for s, t in zip(seqs, tables)], page_size, dev)
    return worst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ok = True
    print(f"{'shape':<14}{'dtype':<10}{'max rel. logit error':>22}  verdict")
    for shape in SHAPES:
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2), (torch.float16, 1e-2)):
            if args.device == "cpu" and dtype != torch.float32:
                continue
            err = check(shape, dtype, args.device)
            verdict = "ok" if err <= tol else f"FAIL (> {tol})"
            ok &= err <= tol
            print(f"{shape:<14}{str(dtype).split('.')[-1]:<10}{err:>22.2e}  {verdict}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
