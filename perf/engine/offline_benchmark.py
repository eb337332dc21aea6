"""Offline throughput: kvshare's engine beside HF transformers on the same requests, in one process.

    python perf/engine/offline_benchmark.py --model dummy:llama-2-7b --device cuda --dtype float16 \
        --workloads seed-12x128,seed-hot10,fixed-64 --baselines generate,no-sharing
    python perf/engine/offline_benchmark.py            # CPU: SmolLM2-135M, small workloads

Workloads are perf/core/workload_traces.py's seeded token-id traces (closed loop: `concurrency`
requests in flight; output lengths forced, EOS ignored). HF `generate` runs them as static batches
of `concurrency` (seed 000's baseline); `generate_batch` is HF's own continuous batching.
Prints output tok/s, TTFT p50/p95, peak KV pages and the ratios; --json writes the rows.
--repeat N runs each kvshare row N times and keeps the run with the median tok/s, so that one slow
run does not make the row (the JSON keeps every run's figure). --min-tokens sends the serving load's
parameters (min_tokens = max_tokens); --engine-loop drives the engine through the server's engine
thread instead of stepping it here: together they take a serving gap apart without Triton
(docs/develop/engine.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.core.workload_traces import Trace, make_trace  # noqa: E402
from perf.engine.step_profile import StepProfile, format_summary  # noqa: E402

from kvshare.core.types import PoolStats  # noqa: E402
from kvshare.engine.engine import LLMEngine  # noqa: E402
from kvshare.engine.engine_config import EngineConfig  # noqa: E402
from kvshare.engine.engine_loop import EngineLoop, Submission  # noqa: E402
from kvshare.engine.gc_tuning import freeze_startup_heap, thaw  # noqa: E402
from kvshare.runtime.weights import LoadedModel, load_model  # noqa: E402
from kvshare.sampling_params import SamplingParams  # noqa: E402


@dataclass(frozen=True)
class Row:
    workload: str
    system: str
    requests: int
    output_tokens: int
    seconds: float
    tok_per_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    peak_kv_pages: int | None
    prefix_hit_rate: float | None
    peak_kv_gb: float | None = None     # peak pages x bytes per page (the KV memory the requests held)
    step_profile: dict | None = None    # --step-profile: seconds per step kind (perf/engine/step_profile.py)
    runs_tok_per_s: list[float] | None = None   # --repeat N > 1: every run's tok/s, in run order
    prompt_tokens_computed: int | None = None   # prompt tokens not served by any tier (preemptions recompute)
    tiers: dict | None = None           # host/disk tier counters of the timed requests (when a tier is on)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return 1e3 * values[min(len(values) - 1, int(q * len(values)))]


def hit_rate_since(before: PoolStats, after: PoolStats) -> float:
    """Prefix-cache hit rate (prompt tokens served from shared pages) of the lookups between two snapshots."""
    queries = after.prefix_queries_tokens_total - before.prefix_queries_tokens_total
    hits = after.prefix_hits_tokens_total - before.prefix_hits_tokens_total
    return hits / queries if queries else 0.0


def computed_since(before: PoolStats, after: PoolStats) -> int:
    """Prompt tokens the admissions between two snapshots had to compute (looked up, not served)."""
    return (after.prefix_queries_tokens_total - before.prefix_queries_tokens_total
            - (after.prefix_hits_tokens_total - before.prefix_hits_tokens_total))


_TIER_COUNTERS = ("host_hits_tokens_total", "disk_hits_tokens_total", "host_spills_total", "host_loads_total",
                  "host_evictions_total", "disk_writes_total", "disk_reads_total", "disk_evictions_total",
                  "disk_read_failures_total", "faults_gpu_total", "faults_host_total", "faults_disk_total")


def tiers_since(before: PoolStats, after: PoolStats) -> dict | None:
    if not after.host_pages_total:
        return None
    moved = {name: getattr(after, name) - getattr(before, name) for name in _TIER_COUNTERS}
    return {"host_pages": after.host_pages_total, "disk_pages": after.disk_pages_total, **moved}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def limit(trace: Trace, max_requests: int | None, output_tokens: int | None, vocab: int) -> Trace:
    reqs = trace.requests[: max_requests or len(trace.requests)]
    reqs = tuple(replace(r, prompt_ids=tuple(t % vocab for t in r.prompt_ids),
                         max_new_tokens=output_tokens or r.max_new_tokens) for r in reqs)
    return replace(trace, requests=reqs)


def median_run(runs: Sequence[Row]) -> Row:
    """The run with the median tok/s, carrying every run's figure. Of an even count the lower middle
    one: the row stays one measured run (its TTFT, KV and step profile agree with its tok/s)."""
    if not runs:
        raise ValueError("no runs")
    middle = sorted(runs, key=lambda r: r.tok_per_s)[(len(runs) - 1) // 2]
    return replace(middle, runs_tok_per_s=[r.tok_per_s for r in runs] if len(runs) > 1 else None)


def run_repeated(run: Callable[[], Row], repeat: int) -> Row:
    runs = [run() for _ in range(repeat)]
    if repeat > 1:
        print(f"   {runs[0].system}: tok/s per run {', '.join(f'{r.tok_per_s:.1f}' for r in runs)}; "
              "kept the median", flush=True)
    return median_run(runs)


def warm_up(engine: LLMEngine, trace: Trace, vocab: int) -> None:
    """Untimed: Triton's JIT compiles each kernel variant the first time a shape class appears (~0.3 s
    each on the H200), so run the trace's first batch twice for 2 tokens, with prompts shifted by one
    token id (no cache hit for the real run): the first pass compiles full prefills, the second the
    cached-prefix extends (its prompts now hit the cache where sharing is on)."""
    n = min(len(trace.requests), max(trace.concurrency or 1, 1), 64)
    for attempt in range(2):
        for i, r in enumerate(trace.requests[:n]):
            engine.add_request(f"warm-{attempt}-{i}", [(t + 1) % vocab for t in r.prompt_ids],
                               SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while engine.has_work:
            engine.step()


def request_params(args, r) -> SamplingParams:
    """Greedy (or --temperature), EOS ignored; --min-tokens also forces the length with min_tokens, as
    the serving load (perf/load/serving_load.py) asks both servers to."""
    return SamplingParams(max_tokens=r.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          ignore_eos=True, min_tokens=r.max_new_tokens if args.min_tokens else 0)


class Tally:
    """Output tokens and TTFTs of a closed loop, from the outputs as they come."""

    def __init__(self) -> None:
        self.out_tokens = 0
        self.ttft: list[float] = []
        self._arrival: dict[str, float] = {}

    def arrived(self, rid: str) -> None:
        self._arrival[rid] = time.perf_counter()

    def take(self, o) -> bool:
        """Counts one output; True when it is its request's last."""
        self.out_tokens += len(o.token_ids)
        at = self._arrival.pop(o.request_id, None) if o.token_ids else None
        if at is not None:          # the request's first tokens
            self.ttft.append(time.perf_counter() - at)
        return o.finished


def drive_steps(engine: LLMEngine, requests, params: Callable, concurrency: int,
                profile: StepProfile | None) -> tuple[int, list[float], int]:
    """Closed loop on this thread: add requests while fewer than `concurrency` are in flight, step.
    Returns (output tokens, TTFTs in s, peak active pages)."""
    pending = list(requests)
    in_flight: set[str] = set()
    tally = Tally()
    peak = 0
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            r = pending.pop(0)
            rid = str(r.request_id)
            engine.add_request(rid, list(r.prompt_ids), params(r))
            tally.arrived(rid)
            in_flight.add(rid)
        t_step = time.perf_counter()
        outputs = engine.step()
        if profile is not None:
            profile.add(engine.last_step, time.perf_counter() - t_step)
        for o in outputs:
            if tally.take(o):
                in_flight.discard(o.request_id)
        peak = max(peak, engine.stats().pool.active)
    return tally.out_tokens, tally.ttft, peak


def drive_engine_loop(engine: LLMEngine, requests, params: Callable, concurrency: int,
                      step_log_s: float) -> tuple[int, list[float], None]:
    """The same closed loop through the server's engine thread (EngineLoop) without Triton: this
    thread submits as Triton's execute() does and reads each step's outputs from a batch sink's
    queue as the response pump does, so the loop's own cost shows beside drive_steps'. The loop logs
    its step periods by kind every step_log_s (engine/step_meter.py). Peak pages are not read (the
    pool belongs to the engine thread)."""
    import queue

    done: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine, step_log_s=step_log_s)
    pending = list(requests)
    tally = Tally()
    in_flight = 0
    try:
        while pending or in_flight:
            while pending and in_flight < concurrency:
                r = pending.pop(0)
                rid = str(r.request_id)
                tally.arrived(rid)
                loop.submit(Submission(rid, list(r.prompt_ids), params(r), "", False, None, None, batch_sink=done.put))
                in_flight += 1
            for o in done.get():
                if tally.take(o):
                    in_flight -= 1
                    if o.error:
                        raise RuntimeError(f"request {o.request_id}: {o.error}")
    finally:
        loop.shutdown()
    return tally.out_tokens, tally.ttft, None


def run_kvshare(loaded: LoadedModel, trace: Trace, args, *, sharing: bool, label: str) -> Row:
    concurrency = len(trace.requests) if args.open_loop else (trace.concurrency or 64)
    # every run starts with an empty disk tier of its own (a warm one would serve the previous run's pages)
    disk_dir = ""
    if args.disk_cache_dir:
        Path(args.disk_cache_dir).mkdir(parents=True, exist_ok=True)
        disk_dir = tempfile.mkdtemp(prefix="kvshare-disk-", dir=args.disk_cache_dir)
    try:
        return _run_kvshare(loaded, trace, args, sharing, label, concurrency, disk_dir)
    finally:
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)


ACTIVATION_MARGIN_GB = 4.0   # activations, CUDA graphs and the allocator's slack beside the pool


def fit_kv_gb(requested_gb: float, total_gb: float, weights_gb: float) -> float:
    """The pool asked for, or on a smaller GPU what vLLM's gpu_memory_utilization 0.9 leaves for KV
    (a row sized for an H200 then runs on an H100 beside vLLM's pool there)."""
    return min(requested_gb, float(int(0.9 * total_gb - weights_gb - ACTIVATION_MARGIN_GB)))


def _run_kvshare(loaded: LoadedModel, trace: Trace, args, sharing: bool, label: str, concurrency: int,
                 disk_dir: str) -> Row:
    cfg = EngineConfig(model=loaded.source, device=args.device, dtype=args.dtype, page_size=args.page_size,
                       cpu_weights=args.cpu_weights, kv_cache_memory_gb=args.kv_gb, kv_cache_dtype=args.kv_cache_dtype,
                       host_cache_memory_gb=args.host_cache_gb,
                       disk_cache_dir=disk_dir if sharing else "", disk_cache_gb=args.disk_cache_gb,
                       host_cache_min_hits=args.host_min_hits, max_running=args.max_running or max(trace.concurrency or 64, 1),
                       max_step_tokens=args.max_step_tokens, max_prefill_chunk=args.max_prefill_chunk,
                       max_model_len=args.max_model_len,
                       enable_prefix_caching=sharing, overlap_schedule=args.overlap, cascade_attention=args.cascade, eviction=args.eviction,
                       **({"mixed_graph_max_tokens": args.mixed_graphs} if args.mixed_graphs is not None else {}),
                       **({"admission": args.admission} if args.admission else {}),
                       **({"admission_delay_steps": args.admission_delay} if args.admission_delay is not None else {}))
    engine = LLMEngine(cfg, loaded=loaded)
    kv = engine.kv
    print(f"   {label}: KV pool of {kv.num_pages} pages x {kv.page_size} tokens ({kv.dtype}, "
          f"{kv.nbytes / 1e9:.2f} GB, {kv.bytes_per_token} bytes per token)", flush=True)
    warm_up(engine, trace, loaded.config.vocab_size)
    freeze_startup_heap()   # as the server does: no full GC walks over the weights' objects per step
    # The warm-up's second pass hits the cache by design; the row's hit rate counts the timed requests only.
    warm = engine.stats().pool
    device = torch.device(args.device)
    profile = StepProfile() if args.step_profile and not args.engine_loop else None
    params = partial(request_params, args)
    _sync(device)
    start = time.perf_counter()
    if args.engine_loop:
        out_tokens, ttft, peak = drive_engine_loop(engine, trace.requests, params, concurrency, args.step_log_s)
    else:
        out_tokens, ttft, peak = drive_steps(engine, trace.requests, params, concurrency, profile)
    _sync(device)
    secs = time.perf_counter() - start
    steps = profile.summary(secs) if profile is not None else None
    if steps is not None:
        print(f"   step profile of {label} ({secs:.2f} s):\n{format_summary(steps, secs)}", flush=True)
    pool = engine.stats().pool
    page_bytes = engine.kv.page_size * engine.kv.bytes_per_token
    engine.close()
    del engine
    thaw()
    row = Row(trace.name, label, len(trace.requests), out_tokens, secs, out_tokens / secs, _pct(ttft, 0.5),
              _pct(ttft, 0.95), peak, hit_rate_since(warm, pool), None if peak is None else round(peak * page_bytes / 1e9, 2), steps,
              prompt_tokens_computed=computed_since(warm, pool), tiers=tiers_since(warm, pool))
    print(f"   {label}: {row.prompt_tokens_computed:,} prompt tokens computed"
          + (f"; tiers {row.tiers}" if row.tiers else ""), flush=True)
    return row


def hf_model(loaded: LoadedModel, args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    dtype = getattr(torch, args.dtype)
    if loaded.source.startswith("dummy:"):
        c = loaded.config
        hf_cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                             num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                             num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                             max_position_embeddings=c.max_position, rope_theta=c.rope_theta,
                             tie_word_embeddings=c.tie_word_embeddings)
        with torch.device(args.device):
            return AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    from kvshare.runtime.tokenizer import hf_location

    where, kw = hf_location(loaded.source)
    return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw).to(args.device).eval()


def run_hf_generate(model, trace: Trace, args) -> Row:
    device = torch.device(args.device)
    batch = trace.concurrency or 64
    reqs = list(trace.requests)
    ttft: list[float] = []
    out_tokens = 0
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i:i + batch]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(group):           # left padding, as generate expects for decoder-only models
            ids[j, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[j, width - len(r.prompt_ids):] = 1
        n = max(r.max_new_tokens for r in group)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        _sync(device)
        # A static batch returns everything at the end: every request's first token waits for the whole batch.
        ttft.extend([time.perf_counter() - t0] * len(group))
        out_tokens += (out.shape[1] - width) * len(group)
    secs = time.perf_counter() - start
    return Row(trace.name, "hf-generate", len(reqs), out_tokens, secs, out_tokens / secs, _pct(ttft, 0.5),
               _pct(ttft, 0.95), None, None)


def run_hf_generate_batch(model, trace: Trace, args) -> Row:
    from transformers import GenerationConfig

    device = torch.device(args.device)
    n = max(r.max_new_tokens for r in trace.requests)
    cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0,
                           max_batch_tokens=args.max_step_tokens)
    _sync(device)
    start = time.perf_counter()
    # no_grad, not inference_mode: generate_batch's worker thread updates in place the tensors it
    # creates here, which inference-mode tensors forbid outside inference mode (seen with 5.17).
    with torch.no_grad():
        out = model.generate_batch(inputs=[list(r.prompt_ids) for r in trace.requests], generation_config=cfg,
                                   progress_bar=False)
    _sync(device)
    secs = time.perf_counter() - start
    tokens = sum(len(v.generated_tokens) for v in out.values())
    return Row(trace.name, "hf-generate_batch", len(trace.requests), tokens, secs, tokens / secs, None, None, None, None)


def parse_workload(spec: str, max_requests: int | None, baselines: list[str]) -> tuple[str, int | None, list[str]]:
    """'name[:max_requests[:baseline+baseline]]' -> (name, max_requests, baselines); omitted parts default."""
    name, *rest = spec.split(":")
    if rest and rest[0]:
        max_requests = int(rest[0])
    if len(rest) > 1:
        baselines = [b for b in rest[1].split("+") if b]
    return name, max_requests, baselines


def system_label(row: Row) -> str:
    n = len(row.runs_tok_per_s or ())
    return f"{row.system} (median of {n})" if n > 1 else row.system


def print_table(rows: list[Row]) -> None:
    width = max([20] + [len(system_label(r)) + 2 for r in rows])
    head = f"{'workload':<16}{'system':<{width}}{'reqs':>5}{'out tok':>9}{'s':>8}{'tok/s':>9}{'TTFT p50':>10}" \
           f"{'p95 ms':>9}{'KV GB':>7}{'hit':>6}{'vs hf-gen':>10}{'vs gen_b':>9}{'vs no-sh':>9}"
    print(head)
    print("-" * len(head))
    base = {r.workload: r.tok_per_s for r in rows if r.system == "hf-generate"}
    base_b = {r.workload: r.tok_per_s for r in rows if r.system == "hf-generate_batch"}
    base_ns = {r.workload: r.tok_per_s for r in rows if r.system.startswith("kvshare-no-sharing")}

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        def ratio(b):
            return r.tok_per_s / b[r.workload] if b.get(r.workload) else None

        print(f"{r.workload:<16}{system_label(r):<{width}}{r.requests:>5}{r.output_tokens:>9}{r.seconds:>8.1f}"
              f"{r.tok_per_s:>9.1f}"
              f"{f(r.ttft_p50_ms, '.0f'):>10}{f(r.ttft_p95_ms, '.0f'):>9}{f(r.peak_kv_gb, '.2f'):>7}"
              f"{f(r.prefix_hit_rate, '.2f'):>6}{f(ratio(base), '.2f'):>10}{f(ratio(base_b), '.2f'):>9}"
              f"{f(ratio(base_ns), '.2f'):>9}")


def overlap_label(overlap: bool | None) -> str:
    """Only an explicit --overlap / --no-overlap names itself; the engine's default is unlabelled."""
    return {True: "overlap", False: "no overlap", None: ""}[overlap]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=".gguf, HF dir or dummy:<name>; default SmolLM2-135M")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: float16 on CUDA, float32 on CPU")
    ap.add_argument("--workloads", default="seed-12x128,seed-hot10",
                    help="comma-separated name[:max_requests[:baseline+baseline]], e.g. fixed-64:128:generate+generate_batch")
    ap.add_argument("--baselines", default="generate,no-sharing", help="any of generate,generate_batch,no-sharing")
    ap.add_argument("--max-requests", type=int, default=None, help="cut each trace to this many requests")
    ap.add_argument("--output-tokens", type=int, default=None, help="override every request's output length")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-gb", type=float, default=None, help="KV pool size; default 40 on CUDA, 1 on CPU")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="KV page layout: auto (the model's dtype), fp8_e4m3, int8 (per-token scales); a comma "
                         "list runs each workload once per layout, on one loaded model")
    ap.add_argument("--host-cache-gb", type=float, default=0.0,
                    help="host tier below the pool (EngineConfig.host_cache_memory_gb; 0 = none): evicted prefix "
                         "pages are kept there and loaded back instead of recomputed")
    ap.add_argument("--host-min-hits", type=int, default=1,
                    help="spill only pages that many admissions shared (0: every evicted page)")
    ap.add_argument("--disk-cache-dir", default="",
                    help="disk tier below the host tier (EngineConfig.disk_cache_dir; needs --host-cache-gb): each "
                         "run writes through to a fresh subdirectory here, removed after the run")
    ap.add_argument("--disk-cache-gb", type=float, default=16.0, help="the disk tier's size bound")
    ap.add_argument("--max-step-tokens", type=int, default=4096)
    ap.add_argument("--max-prefill-chunk", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="context bound (EngineConfig.max_model_len; default the model's window): it also sizes "
                         "the decode graphs' split-K, so a 128k-window model benchmarked at 32k sets it")
    ap.add_argument("--max-running", type=int, default=None, help="engine batch limit; default the trace's concurrency")
    ap.add_argument("--open-loop", action="store_true",
                    help="submit every request at once (SGLang's --request-rate inf): the engine's queue and "
                         "admission policy decide the order; TTFT then includes queueing")
    ap.add_argument("--admission", default=None, help="engine admission policy (fcfs | cache_aware); default the engine's")
    ap.add_argument("--admission-delay", type=int, default=None, metavar="N",
                    help="hold arrivals back up to N decode-only steps to batch their prefills "
                         "(EngineConfig.admission_delay_steps); default the engine's")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="kvshare rows only: sample at this temperature (0 = greedy, as the HF baselines)")
    ap.add_argument("--top-k", type=int, default=0, help="kvshare rows only: top-k when sampling")
    ap.add_argument("--eviction", default="lru", help="prefix-cache eviction policy: lru | lfu | fifo | second-chance")
    ap.add_argument("--cascade", action=argparse.BooleanOptionalAction, default=True,
                    help="cascade (shared-prefix) decode attention on CUDA (EngineConfig.cascade_attention)")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="overlap scheduling: schedule step N+1 while step N runs (EngineConfig.overlap_schedule); "
                         "default the engine's (on for CUDA, off on the CPU)")
    ap.add_argument("--mixed-graphs", default="",
                    help="largest step with a prefill chunk replayed from a CUDA graph "
                         "(EngineConfig.mixed_graph_max_tokens; 0: such steps run eagerly); a comma list runs each "
                         "workload once per value, on one loaded model; default the engine's")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each kvshare row N times and keep the one with the median tok/s")
    ap.add_argument("--cpu-weights", default="blocks", choices=["blocks", "fp32"],
                    help="CPU, a GGUF model: its linear layers in the file's blocks (the engine's default) or fp32")
    ap.add_argument("--min-tokens", action="store_true",
                    help="requests also set min_tokens = max_tokens (what the serving load sends both servers)")
    ap.add_argument("--engine-loop", action="store_true",
                    help="drive the engine through the server's engine thread (EngineLoop, a batch sink, no "
                         "Triton) instead of stepping it here; its step periods are logged by kind")
    ap.add_argument("--step-log-s", type=float, default=2.0,
                    help="with --engine-loop: the loop's step-period log interval in seconds")
    ap.add_argument("--step-profile", action="store_true",
                    help="time every engine step; print seconds per step kind (prefill, mixed, decode per path)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.engine_loop:    # the loop's step meter logs at INFO (kvshare.engine)
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
        logging.getLogger("kvshare.engine").setLevel(logging.INFO)
    args.dtype = args.dtype or ("float16" if args.device.startswith("cuda") else "float32")
    args.kv_gb = args.kv_gb or (40.0 if args.device.startswith("cuda") else 1.0)
    if args.device == "cpu":
        torch.backends.mkldnn.enabled = True
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device,
                        cpu_blocks=args.cpu_weights == "blocks")
    if args.device.startswith("cuda"):
        fitted = fit_kv_gb(args.kv_gb, torch.cuda.get_device_properties(0).total_memory / 2**30,
                           torch.cuda.memory_allocated() / 2**30)
        if fitted < args.kv_gb:
            print(f"--kv-gb {args.kv_gb:g} does not fit this GPU: the pool is {fitted:g} GiB "
                  f"(0.9 of its memory less the weights and {ACTIVATION_MARGIN_GB:g} GiB, as vLLM's default leaves)")
            args.kv_gb = fitted
    default_baselines = [b for b in args.baselines.split(",") if b]
    specs = [parse_workload(w, args.max_requests, default_baselines) for w in args.workloads.split(",") if w]
    hf = hf_model(loaded, args) if any({"generate", "generate_batch"} & set(b) for _, _, b in specs) else None
    rows: list[Row] = []
    # Non-default engine settings go into the row label, so result files say what ran.
    kv_dtypes = [d for d in args.kv_cache_dtype.split(",") if d]
    for d in kv_dtypes:
        if d not in ("auto", "fp8_e4m3", "int8"):
            ap.error(f"--kv-cache-dtype: '{d}' is not auto, fp8_e4m3 or int8")
    settings = [f"{args.admission}" if args.admission else "",
                f"delay {args.admission_delay}" if args.admission_delay is not None else "", overlap_label(args.overlap),
                "" if args.cascade else "no cascade", "" if args.eviction == "lru" else args.eviction,
                f"host {args.host_cache_gb:g} GB" + ("" if args.host_min_hits == 1 else f" min hits {args.host_min_hits}")
                if args.host_cache_gb else "",
                f"disk {args.disk_cache_gb:g} GB" if args.disk_cache_dir else "",
                f"T={args.temperature:g}" if args.temperature else "", f"top-k {args.top_k}" if args.top_k else "",
                "min_tokens" if args.min_tokens else "", "engine loop" if args.engine_loop else ""]

    try:
        mixed_graphs = [int(x) for x in args.mixed_graphs.split(",") if x] or [None]
    except ValueError:
        ap.error(f"--mixed-graphs: '{args.mixed_graphs}' is not a comma list of token counts")

    def variant(kv_dtype: str, mixed: int | None) -> str:
        mixed_label = "" if mixed is None else (f"mixed graphs <= {mixed}" if mixed else "no mixed graphs")
        parts = [x for x in ["" if kv_dtype == "auto" else f"kv {kv_dtype}", mixed_label, *settings] if x]
        return f" ({', '.join(parts)})" if parts else ""

    for name, max_requests, baselines in specs:
        trace = limit(make_trace(name), max_requests, args.output_tokens, loaded.config.vocab_size)
        print(f"== {trace.name}: {len(trace.requests)} requests, concurrency {trace.concurrency}", flush=True)
        for kv_dtype, mixed in itertools.product(kv_dtypes, mixed_graphs):
            kv_args = argparse.Namespace(**{**vars(args), "kv_cache_dtype": kv_dtype, "mixed_graphs": mixed})
            rows.append(run_repeated(partial(run_kvshare, loaded, trace, kv_args, sharing=True,
                                             label="kvshare" + variant(kv_dtype, mixed)), args.repeat))
            if "no-sharing" in baselines:
                rows.append(run_repeated(partial(run_kvshare, loaded, trace, kv_args, sharing=False,
                                                 label="kvshare-no-sharing" + variant(kv_dtype, mixed)), args.repeat))
        if "generate" in baselines:
            rows.append(run_hf_generate(hf, trace, args))
        if "generate_batch" in baselines:
            try:
                rows.append(run_hf_generate_batch(hf, trace, args))
            except Exception as exc:  # its API moves between transformers releases: report, don't hide
                print(f"   hf generate_batch failed: {type(exc).__name__}: {exc}", flush=True)
        print_table(rows)
        if args.json:   # after every workload: a run cut short keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\nmachine: {dev}; torch {torch.__version__}; model {loaded.source} {args.dtype}; page size {args.page_size}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
