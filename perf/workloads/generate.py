#!/usr/bin/env python3
"""benchmarks.md's workloads as reproducible data files, made with the served model's tokenizer.

    python -m perf.workloads.generate                       # all workloads -> runs/workloads/
    python -m perf.workloads.generate -o DIR --workloads seed-12x128,seed-hot10 [--seed 0] [--check]
    python -m perf.workloads.generate --model /path/model.gguf   # another served model's tokenizer

The *shapes* come from perf/core/workload_traces.py (imported, not copied): which requests share
which prefix, prompt/output lengths, concurrency, Poisson arrival times. Each trace token (an id of
that module's 32000-id pseudo-vocabulary) becomes a *word* of the served model's tokenizer: the
words are the tokenizer's own lowercase vocabulary entries that are exactly one token both with and
without a leading space, so a prompt of N words tokenizes to exactly N tokens and two prompts that
share a prefix in the trace share the same text prefix and the same token-id prefix. Every prompt is
re-tokenized (kvshare.runtime.tokenizer.encode_prompt, what the server's preprocessing does) and its
measured token count is checked and recorded.

Files per workload NAME (all JSON Lines, one request per line, in request order):
  NAME.jsonl           {"prompt": text, "max_tokens": n, "min_tokens": n, "ignore_eos": true}
                       -> the `ensemble` model; kvshare_client.load_workload / Locust --kvshare-workload
  NAME.ids.jsonl       {"input_ids": [...], "max_tokens": n, "min_tokens": n, "ignore_eos": true}
                       -> the `llm_engine` model (same prompts, tokenized)
  NAME.schedule.jsonl  {"index", "arrival_s", "prompt_tokens", "max_tokens", "group"}
                       (arrival_s: Poisson arrivals for `mixed`, 0 for closed-loop workloads)
and manifest.json: per workload the concurrency, counts, measured token statistics, the share of
prompt tokens reusable from earlier requests (16-token pages) and the sha256 of every file.
--check regenerates into a temporary directory and compares the checksums with a manifest (default:
perf/workloads/manifest.json, committed: the files of seed 0 with SmolLM2-135M's tokenizer).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from perf.core import workload_traces as wt  # noqa: E402

DEFAULT_OUT = ROOT / "runs" / "workloads"
COMMITTED_MANIFEST = Path(__file__).resolve().parent / "manifest.json"  # checksums of the SmolLM2 files, seed 0

# name -> trace builder for a seed (the shapes of benchmarks.md, from workload_traces).
BUILDERS: dict[str, Callable[[int], "wt.Trace"]] = {
    "seed-12x128": lambda s: wt.seed_12x128(s),
    "seed-hot10": lambda s: wt.seed_hot10(s),
    "seed-long": lambda s: wt.seed_long(s),
    "fixed-1": lambda s: wt.fixed_b(1, s),
    "fixed-64": lambda s: wt.fixed_b(64, s),
    "fixed-256": lambda s: wt.fixed_b(256, s),
    "shared-prefix": lambda s: wt.shared_prefix(s),
    "prefix-repetition": lambda s: wt.prefix_repetition(s),
    "mixed": lambda s: wt.mixed(s),
}
WORKLOADS = tuple(BUILDERS)


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    prompt: str
    input_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float
    group: str  # requests with the same group send the same prompt prefix source (hot prompt / prefix)


def single_token_words(tokenizer) -> list[str]:
    """Lowercase words that the tokenizer encodes as exactly one token, with and without a leading space.

    Sorted, so the list (and every file made from it) depends only on the tokenizer's vocabulary.
    """
    from kvshare.runtime.tokenizer import encode_prompt

    vocab = tokenizer.get_vocab()
    # Byte-level BPE (GPT-2 style, SmolLM2, Llama 3) marks a leading space with 'Ġ', SentencePiece with '▁'.
    cands = sorted({k[1:] for k in vocab if k[:1] in ("Ġ", "▁") and re.fullmatch(r"[a-z]{3,12}", k[1:])})
    words = [w for w in cands
             if len(encode_prompt(tokenizer, " " + w, chat=False)) == len(encode_prompt(tokenizer, "x", chat=False))
             and len(encode_prompt(tokenizer, w, chat=False)) == len(encode_prompt(tokenizer, "x", chat=False))]
    if len(words) < 512:
        raise RuntimeError(f"only {len(words)} single-token words in this tokenizer's vocabulary: too few")
    return words


def _special_overhead(tokenizer) -> int:
    """Tokens encode_prompt adds around any text (e.g. a BOS); 0 for SmolLM2."""
    from kvshare.runtime.tokenizer import encode_prompt

    return len(encode_prompt(tokenizer, "x", chat=False)) - 1


def _group_of(trace: "wt.Trace", prefix_len: int) -> list[str]:
    """A label per request: requests whose first `prefix_len` trace tokens are equal get the same one."""
    labels: dict[tuple[int, ...], str] = {}
    out = []
    for r in trace.requests:
        key = r.prompt_ids[:prefix_len] if prefix_len else r.prompt_ids
        out.append(labels.setdefault(key, f"g{len(labels)}"))
    return out


_GROUP_PREFIX = {"shared-prefix": 2048, "prefix-repetition": 256}


def build(name: str, tokenizer, *, seed: int = wt.DEFAULT_SEED, words: Sequence[str] | None = None) -> list[WorkloadRequest]:
    """The requests of workload `name` as text + token ids; raises if a prompt's token count is off."""
    from kvshare.runtime.tokenizer import encode_prompt

    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    trace = BUILDERS[name](seed)
    words = list(words) if words is not None else single_token_words(tokenizer)
    extra = _special_overhead(tokenizer)
    groups = _group_of(trace, _GROUP_PREFIX.get(name, 0))
    out = []
    for r, group in zip(trace.requests, groups):
        text = " ".join(words[t % len(words)] for t in r.prompt_ids)
        ids = tuple(encode_prompt(tokenizer, text, chat=False))
        if len(ids) != len(r.prompt_ids) + extra:
            raise RuntimeError(f"{name}[{r.request_id}]: {len(ids)} tokens, expected {len(r.prompt_ids) + extra}")
        out.append(WorkloadRequest(r.request_id, text, ids, r.max_new_tokens, round(r.arrival_s, 6), group))
    return out


def concurrency_of(name: str, seed: int = wt.DEFAULT_SEED) -> int | None:
    return BUILDERS[name](seed).concurrency


def _reusable_share(reqs: Sequence[WorkloadRequest], page_size: int = 16) -> float:
    seen: set[int] = set()
    reused = total = 0
    for r in reqs:
        key = 0
        total += len(r.input_ids)
        for start in range(0, len(r.input_ids) - page_size + 1, page_size):
            key = hash((key, r.input_ids[start:start + page_size]))
            reused += page_size if key in seen else 0
            seen.add(key)
    return reused / total if total else 0.0


def _dump(lines: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n" for line in lines)


def workload_files(name: str, reqs: Sequence[WorkloadRequest]) -> dict[str, str]:
    """File name -> content for one workload (deterministic: same requests, same bytes)."""
    forced = lambda r: {"max_tokens": r.max_tokens, "min_tokens": r.max_tokens, "ignore_eos": True}  # noqa: E731
    return {
        f"{name}.jsonl": _dump({"prompt": r.prompt, **forced(r)} for r in reqs),
        f"{name}.ids.jsonl": _dump({"input_ids": list(r.input_ids), **forced(r)} for r in reqs),
        f"{name}.schedule.jsonl": _dump({"index": r.index, "arrival_s": r.arrival_s, "prompt_tokens": len(r.input_ids),
                                         "max_tokens": r.max_tokens, "group": r.group} for r in reqs),
    }


def summary(name: str, reqs: Sequence[WorkloadRequest], seed: int) -> dict[str, Any]:
    p = [len(r.input_ids) for r in reqs]
    o = [r.max_tokens for r in reqs]
    conc = concurrency_of(name, seed)
    return {"requests": len(reqs), "concurrency": conc, "arrivals": "closed loop" if conc else "poisson",
            "prompt_tokens_mean": round(statistics.fmean(p), 1), "prompt_tokens_min": min(p),
            "prompt_tokens_max": max(p), "output_tokens_mean": round(statistics.fmean(o), 1),
            "distinct_prompts": len({r.prompt for r in reqs}), "groups": len({r.group for r in reqs}),
            "reusable_prompt_share": round(_reusable_share(reqs), 4),
            "duration_s": round(max(r.arrival_s for r in reqs), 3) if not conc else None}


def generate(out_dir: Path, names: Sequence[str], *, seed: int = wt.DEFAULT_SEED, model: str | None = None,
             tokenizer=None, progress: bool = True) -> dict[str, Any]:
    """Write the files of `names` into out_dir and its manifest.json; returns the manifest."""
    from kvshare.runtime.tokenizer import default_model_source, load_tokenizer

    tokenizer = tokenizer or load_tokenizer(model)
    words = single_token_words(tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "generator": "perf/workloads/generate.py", "seed": seed,
        "tokenizer": Path(model or default_model_source()).name, "vocab_words": len(words),
        "words_sha256": hashlib.sha256("\n".join(words).encode()).hexdigest(), "workloads": {}}
    try:
        from tqdm import tqdm
        it = tqdm(names, desc="workloads", disable=not progress)
    except ImportError:
        it = names
    for name in it:
        reqs = build(name, tokenizer, seed=seed, words=words)
        entry = summary(name, reqs, seed)
        entry["files"] = {}
        for fname, content in workload_files(name, reqs).items():
            data = content.encode("utf-8")
            (out_dir / fname).write_bytes(data)
            entry["files"][fname] = hashlib.sha256(data).hexdigest()
        manifest["workloads"][name] = entry
    # Keep the entries of workloads generated earlier into the same directory with the same seed/tokenizer.
    mf = out_dir / "manifest.json"
    old = json.loads(mf.read_text()) if mf.exists() else {}
    if all(old.get(k) == manifest[k] for k in ("seed", "tokenizer", "words_sha256")):
        manifest["workloads"] = {**{n: e for n, e in old.get("workloads", {}).items() if n not in names
                                    and all((out_dir / f).exists() for f in e.get("files", {}))},
                                 **manifest["workloads"]}
        manifest["workloads"] = {n: manifest["workloads"][n] for n in WORKLOADS if n in manifest["workloads"]}
    mf.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load_requests(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def ensure(out_dir: Path, names: Sequence[str], *, seed: int = wt.DEFAULT_SEED, model: str | None = None) -> Path:
    """Generate the workloads that out_dir lacks (or that were made with another seed); returns out_dir."""
    mf = out_dir / "manifest.json"
    have = json.loads(mf.read_text()) if mf.exists() else {}
    ok = have.get("seed") == seed and all(n in have.get("workloads", {}) and
                                          all((out_dir / f).exists() for f in have["workloads"][n]["files"])
                                          for n in names)
    if not ok:
        generate(out_dir, sorted(set(names) | set(have.get("workloads", {}) if have.get("seed") == seed else ())),
                 seed=seed, model=model)
    return out_dir


def print_table(manifest: dict[str, Any]) -> None:
    print(f"{'workload':<18}{'reqs':>6}{'conc':>6}{'prompt mean':>12}{'min':>6}{'max':>6}{'out':>6}{'groups':>7}"
          f"{'reusable':>9}")
    for name, e in manifest["workloads"].items():
        print(f"{name:<18}{e['requests']:>6}{str(e['concurrency'] or 'open'):>6}{e['prompt_tokens_mean']:>12}"
              f"{e['prompt_tokens_min']:>6}{e['prompt_tokens_max']:>6}{e['output_tokens_mean']:>6}{e['groups']:>7}"
              f"{e['reusable_prompt_share']:>9.1%}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated; default all")
    ap.add_argument("--seed", type=int, default=wt.DEFAULT_SEED)
    ap.add_argument("--model", default=None, help="served model (.gguf or HF dir) whose tokenizer to use")
    ap.add_argument("--check", nargs="?", const=str(COMMITTED_MANIFEST), default=None, metavar="MANIFEST",
                    help="regenerate into a temp dir and compare checksums with MANIFEST "
                         "(default: the committed perf/workloads/manifest.json)")
    args = ap.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    if args.check:
        want = json.loads(Path(args.check).read_text())
        names = [n for n in names if n in want["workloads"]]
        with tempfile.TemporaryDirectory() as tmp:
            got = generate(Path(tmp), names, seed=want["seed"], model=args.model)
        bad = [n for n in names if want["workloads"].get(n, {}).get("files") != got["workloads"][n]["files"]]
        print("reproducible" if not bad else f"DIFFERENT: {', '.join(bad)}")
        return 1 if bad else 0
    manifest = generate(args.out, names, seed=args.seed, model=args.model)
    print_table(manifest)
    print(f"wrote {args.out}/ (NAME.jsonl text, NAME.ids.jsonl token ids, NAME.schedule.jsonl, manifest.json)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
