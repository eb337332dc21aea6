#!/usr/bin/env python3
"""Write perf_analyzer --input-data JSON for kvshare's models.

    # text prompts for the ensemble (from a workload file, or the built-in prompts)
    python perf/load/make_pa_inputs.py text -o runs/pa/text.json --max-tokens 64 \
        [--workload perf/load/workloads/chat_prompts.jsonl] [--chat]
    # synthetic token ids for llm_engine (optionally all sharing a prefix of --prefix-len ids)
    python perf/load/make_pa_inputs.py tokens -o runs/pa/ids.json --count 64 --input-len 128 \
        --max-tokens 64 --min-tokens 64 [--prefix-len 96]

The tensors come from kvshare_client's own request builder, so they are exactly what the client
sends; perf_analyzer adds the batch dimension itself, so every "shape" here leaves it out.
Streaming is on unless --no-stream (perf_analyzer needs --streaming for these decoupled models).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

try:
    from kvshare_client.types import GenerationRequest
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client"))
    from kvshare_client.types import GenerationRequest

from kvshare_client.wire import WireTensor, build_tensors
from kvshare_client.workload import load_workload, request_from_mapping

BUILTIN_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three uses of a hash table.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
)


def pa_tensor(t: WireTensor) -> dict[str, Any]:
    """One input in perf_analyzer's JSON: flat content plus the shape without the batch dim."""
    flat = t.array.reshape(-1).tolist()
    if t.datatype == "BYTES":
        flat = [v.decode("utf-8") for v in flat]
    return {"content": flat, "shape": list(t.shape[1:])}


def pa_entry(request: GenerationRequest) -> dict[str, Any]:
    return {t.name: pa_tensor(t) for t in build_tensors(request)}


def pa_document(requests: Sequence[GenerationRequest]) -> dict[str, Any]:
    return {"data": [pa_entry(r) for r in requests]}


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "min_tokens": args.min_tokens,
        "temperature": args.temperature,
        "stream": not args.no_stream,
        "cache_salt": args.cache_salt,
        "apply_chat_template": True if getattr(args, "chat", False) else None,
        "ignore_eos": True if args.ignore_eos else None,
    }


def text_requests(args: argparse.Namespace) -> tuple[GenerationRequest, ...]:
    overrides = overrides_from(args)
    if args.workload:
        return load_workload(args.workload, overrides)
    return tuple(request_from_mapping({"prompt": p}, overrides) for p in BUILTIN_PROMPTS)


def token_requests(args: argparse.Namespace) -> tuple[GenerationRequest, ...]:
    if not 0 <= args.prefix_len <= args.input_len:
        raise SystemExit("--prefix-len must be between 0 and --input-len")
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(args.vocab_low, args.vocab_high) for _ in range(n)]

    prefix = ids(args.prefix_len)
    overrides = overrides_from(args)
    return tuple(
        request_from_mapping({"input_ids": prefix + ids(args.input_len - args.prefix_len)}, overrides)
        for _ in range(args.count)
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="kind", required=True)
    for name in ("text", "tokens"):
        sp = sub.add_parser(name)
        sp.add_argument("-o", "--output", required=True)
        sp.add_argument("--max-tokens", type=int, default=64)
        sp.add_argument("--min-tokens", type=int, help="force output lengths (e.g. = --max-tokens)")
        sp.add_argument("--ignore-eos", action="store_true", help="ignore_eos=true (forced output lengths)")
        sp.add_argument("--temperature", type=float)
        sp.add_argument("--cache-salt")
        sp.add_argument("--no-stream", action="store_true")
        if name == "text":
            sp.add_argument("--workload", help="workload file (.jsonl/.json/.txt); default: built-in prompts")
            sp.add_argument("--chat", action="store_true", help="apply_chat_template=true")
        else:
            sp.add_argument("--count", type=int, default=64, help="distinct requests")
            sp.add_argument("--input-len", type=int, default=128)
            sp.add_argument("--prefix-len", type=int, default=0, help="leading ids shared by every request")
            sp.add_argument("--vocab-low", type=int, default=1000)
            sp.add_argument("--vocab-high", type=int, default=30000)
            sp.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    requests = text_requests(args) if args.kind == "text" else token_requests(args)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(pa_document(requests), ensure_ascii=False), encoding="utf-8")
    print(f"{out}: {len(requests)} requests", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
