"""Every supported family on the GPU against HF transformers on the same folder (runtime/model_family.py).

    python perf/engine/check_family_parity.py [--out DIR] [--families gemma2,phi3]

Tiny random models of each family (family_models.py) at head_dim 16 and at the kernels' real head
size 128 (Gemma's real 256 is refused on the GPU: runtime/weights.MAX_GPU_HEAD_DIM), windows of 8 and 32 tokens, are run greedy by HF ``generate`` and by the
engine on CUDA (Triton kernels, page 16, CUDA graphs as configured by default):
  - fp32 (TF32 off): the same tokens as HF and every chosen token's logprob within 1e-3 — the gate;
  - bf16 against HF bf16: the steps until the first differing token and the first step's logprob
    difference (reported; a bf16 near-tie may flip), gated loosely at 0.1;
  - fp8_e4m3 and int8 pages against the engine's own bf16 run (reported).
Prompts are 5 tokens and 3 windows + 5; the pool is checked whole after every run.
Prints one row per (family, head_dim, dtype) and writes family_parity.json under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.engine import family_models  # noqa: E402

NEW = 24


def engine_run(folder: Path, ids: list[int], dtype: str, kv_cache_dtype: str = "auto") -> tuple[list[int], list[float]]:
    from kvshare.engine.engine import LLMEngine
    from kvshare.engine.engine_config import EngineConfig
    from kvshare.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype=dtype, num_pages=256, max_running=8,
                                 kv_cache_dtype=kv_cache_dtype, debug_checks=True))
    eng.add_request("r", ids, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0))
    tokens, logprobs = [], []
    while eng.has_work:
        for o in eng.step():
            if o.error is not None:
                raise RuntimeError(o.error)
            tokens += list(o.token_ids)
            logprobs += list(o.logprobs)
    eng.check_integrity()
    pool = eng.stats().pool
    assert pool.active == 0 and pool.free + pool.cached == pool.total, pool
    del eng
    torch.cuda.empty_cache()
    return tokens, logprobs


def hf_run(folder: Path, ids: list[int], dtype: torch.dtype) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids], device="cuda"), attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                                          device="cuda"),
                             max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def agree(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--families", default="", help="comma-separated tiny model names (default: all)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder to save with the models (default: the "
                                                      "embedded SmolLM2's; the GPU machine gets .carry/family-tokenizer)")
    ap.add_argument("--head-dims", default="16,128", help="16 and/or 128 (128: the kernels' real head size)")
    ap.add_argument("--save-tokenizer", default=None, help="only save the embedded tokenizer there (the carry) and exit")
    args = ap.parse_args()
    if args.save_tokenizer:
        from kvshare.runtime.tokenizer import load_tokenizer

        load_tokenizer(None).save_pretrained(args.save_tokenizer)
        return 0
    if not torch.cuda.is_available():
        print("check_family_parity: no CUDA device")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from kvshare.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    names = [n for n in args.families.split(",") if n] or sorted(family_models.tiny_configs())
    rows, ok = [], True
    print(f"{'model':<12}{'hd':>4}{'win':>4}{'prompt':>7}  {'dtype':<9}{'same tokens':>12}{'max |dlogprob|':>16}  verdict")
    with tempfile.TemporaryDirectory() as tmp:
        for head_dim in (int(h) for h in args.head_dims.split(",")):
            window = 8 if head_dim == 16 else 32
            for name in names:
                hd = head_dim
                try:
                    folder = family_models.build(name, Path(tmp) / f"hd{hd}", tokenizer=tokenizer, head_dim=hd,
                                                 window=window)
                except Exception as exc:          # a shape transformers refuses is a row, not a crash
                    rows.append(dict(model=name, head_dim=hd, error=repr(exc)))
                    print(f"{name:<12}{hd:>4}  build failed: {exc!r}")
                    ok = False
                    continue
                for length in (5, 3 * window + 5):
                    ids = family_models.prompt_ids(1, length, seed=length)[0]
                    for dtype, ref_dtype, gate in (("float32", torch.float32, 1e-3), ("bfloat16", torch.bfloat16, 0.1)):
                        row = dict(model=name, head_dim=hd, window=window, prompt=length, dtype=dtype)
                        try:
                            want, want_lp = hf_run(folder, ids, ref_dtype)
                            got, got_lp = engine_run(folder, ids, dtype)
                            same = agree(got, want)
                            diff = max((abs(a - b) for a, b in zip(got_lp[:same], want_lp[:same])), default=0.0)
                            first = abs(got_lp[0] - want_lp[0]) if got and want else float("inf")
                            passed = (same == NEW and diff <= gate) if dtype == "float32" else first <= gate
                            row.update(same_tokens=same, max_logprob_diff=diff, first_logprob_diff=first, passed=passed)
                            if dtype == "bfloat16":
                                for kv in ("fp8_e4m3", "int8"):
                                    kv_tokens, _ = engine_run(folder, ids, dtype, kv)
                                    row[f"{kv}_same_tokens_vs_bf16"] = agree(kv_tokens, got)
                        except Exception as exc:
                            row.update(error=repr(exc), passed=False)
                        ok &= bool(row["passed"])
                        rows.append(row)
                        extra = "".join(f"  {k[:4]} {row[k]}" for k in row if k.endswith("_vs_bf16"))
                        if "error" in row:
                            print(f"{name:<12}{hd:>4}{window:>4}{length:>7}  {dtype:<9}  ERROR {row['error'][:200]}")
                        else:
                            print(f"{name:<12}{hd:>4}{window:>4}{length:>7}  {dtype:<9}{same:>9}/{NEW}{diff:>16.2e}  "
                                  f"{'ok' if row['passed'] else 'FAIL'}{extra}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "family_parity.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows),
                                                                      indent=1))
    print("family parity:", "ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
