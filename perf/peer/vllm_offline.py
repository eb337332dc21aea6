"""vLLM's offline engine on kvshare's own traces: the peer's side of the `peer` suite.

    python3 -m perf.peer.vllm_offline --rows seed-12x128,seed-long --json OUT/vllm-7b-c12.json
    python3 -m perf.peer.vllm_offline --rows seed-long-32k --plan     # engine and rows; vLLM not imported

The rows are perf/peer/rows.py's (same traces, seeds, request counts and requests in flight as
kvshare's side); the rows given share one engine (model, max_num_seqs, context), built once:
random weights (load_format="dummy") of kvshare's named shape, fp16, vLLM's defaults otherwise
(FA3, CUDA graphs, torch.compile, prefix caching on). Each row is ONE LLM.generate over its
token-id prompts, greedy, EOS ignored, no detokenizing: max_num_seqs bounds what is in flight, so
a closed-loop row keeps its concurrency and the open-loop row (max_num_seqs = requests) submits all.

Before a row's runs: one untimed generate of its first min(n, C, 64) prompts with every token id
shifted by one (2 tokens each), so the warm-up shares no prefix with the timed prompts. Before each
timed run the prefix cache is emptied (the traces share seed 0, so seed-long's prompts start with
seed-12x128's; and run 2 would otherwise hit run 1's pages). A row of `repeat` 3 keeps the run with
the median tok/s (the lower middle of an even count), as offline_benchmark does.

tok/s = output tokens / wall seconds of the timed generate. TTFT from vLLM's per-request stats
(disable_log_stats=False): closed loop from the step that first schedules the request (what
kvshare measures from add_request when a slot frees), open loop from arrival (queueing included, as
kvshare's open loop). Both bases are kept in the JSON; `ttft_p50_ms` is the row's own basis.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.core.workload_traces import make_trace  # noqa: E402
from perf.peer.rows import PeerRow, rows_named, vllm_engines  # noqa: E402

from kvshare.runtime.model_config import NAMED_CONFIGS, ModelConfig  # noqa: E402  (pure dataclasses)

WARM_MAX = 64
# vLLM's environment for an offline run: no usage reports, no hub, and FlashInfer's top-k/top-p
# sampler off (its warm-up JIT-compiles with nvcc and hangs the first engine; greedy never uses it).
VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


@dataclass(frozen=True)
class Run:
    output_tokens: int
    seconds: float
    tok_per_s: float
    ttft_sched_p50_ms: float | None
    ttft_sched_p95_ms: float | None
    ttft_arrival_p50_ms: float | None
    ttft_arrival_p95_ms: float | None
    prefix_hit_rate: float | None
    cache_reset: bool


def hf_config(c: ModelConfig, dtype: str) -> dict[str, Any]:
    """An HF Llama config.json of kvshare's shape (the file a real checkpoint would carry)."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position,
        "rope_theta": c.rope_theta, "hidden_act": "silu", "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": dtype, "attention_bias": c.qkv_bias, "mlp_bias": False, "initializer_range": 0.02,
        "bos_token_id": 1 if c.vocab_size == 32000 else 128000,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_ids[0],
    }
    if c.rope_parameters:
        cfg["rope_scaling"] = dict(c.rope_parameters)
    return cfg


def model_dir(model: str, dtype: str, root: Path) -> Path:
    path = root / f"{model}-dummy"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(NAMED_CONFIGS[model], dtype), indent=1) + "\n")
    return path


def engine_kwargs(rows: Sequence[PeerRow], path: Path, dtype: str, gpu_memory_utilization: float) -> dict[str, Any]:
    model, max_num_seqs, max_model_len = rows[0].engine
    return dict(model=str(path), load_format="dummy", skip_tokenizer_init=True, dtype=dtype, seed=0,
                max_num_seqs=max_num_seqs, max_model_len=max_model_len or NAMED_CONFIGS[model].max_position,
                gpu_memory_utilization=gpu_memory_utilization, disable_log_stats=False)


def token_prompts(row: PeerRow, vocab: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(timed prompts, warm-up prompts, output lengths) of a row, ids folded into the vocabulary
    as kvshare's side folds them."""
    reqs = make_trace(row.workload).requests[: row.requests]
    if len(reqs) < row.requests:
        raise ValueError(f"{row.workload}: the trace has {len(reqs)} requests, the row asks {row.requests}")
    timed = [[t % vocab for t in r.prompt_ids] for r in reqs]
    warm = [[(t + 1) % vocab for t in p] for p in timed[: min(len(timed), row.max_num_seqs, WARM_MAX)]]
    return timed, warm, [r.max_new_tokens for r in reqs]


def pct_ms(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile in ms, as offline_benchmark's _pct."""
    if not values:
        return None
    values = sorted(values)
    return 1e3 * values[min(len(values) - 1, int(q * len(values)))]


def median_run(runs: Sequence[Run]) -> Run:
    if not runs:
        raise ValueError("no runs")
    return sorted(runs, key=lambda r: r.tok_per_s)[(len(runs) - 1) // 2]


def row_record(row: PeerRow, runs: Sequence[Run], system: str, engine: dict[str, Any]) -> dict[str, Any]:
    """One JSON row: offline_benchmark's field names for what both sides have, then vLLM's own."""
    m = median_run(runs)
    basis = "arrival" if row.open_loop else "scheduled"
    p50, p95 = ((m.ttft_arrival_p50_ms, m.ttft_arrival_p95_ms) if row.open_loop
                else (m.ttft_sched_p50_ms, m.ttft_sched_p95_ms))
    return dict(workload=row.workload, system=system, requests=row.requests, output_tokens=m.output_tokens,
                seconds=m.seconds, tok_per_s=m.tok_per_s, ttft_p50_ms=p50, ttft_p95_ms=p95,
                peak_kv_pages=None, prefix_hit_rate=m.prefix_hit_rate,
                runs_tok_per_s=[r.tok_per_s for r in runs] if len(runs) > 1 else None,
                ttft_basis=basis, model=row.model, max_num_seqs=row.max_num_seqs, open_loop=row.open_loop,
                expected_output_tokens=None, median_run=asdict(m), engine=engine)


def prefix_counters(llm) -> tuple[float, float] | None:
    """(queried, hit) prompt tokens so far, from vLLM's own Prometheus counters; None if unreadable."""
    try:
        q = h = 0.0
        for metric in llm.get_metrics():
            if metric.name == "vllm:prefix_cache_queries":
                q += metric.value
            elif metric.name == "vllm:prefix_cache_hits":
                h += metric.value
        return q, h
    except Exception as exc:  # noqa: BLE001 - the hit rate is a diagnostic: report it, keep measuring
        print(f"   get_metrics failed: {type(exc).__name__}: {exc}", flush=True)
        return None


def timed_run(llm, prompts, params) -> Run:
    cache_reset = bool(llm.reset_prefix_cache())
    before = prefix_counters(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - start
    after = prefix_counters(llm)
    sched, arrival = [], []
    for o in outs:
        m = o.metrics
        if m is not None and m.first_token_ts and m.scheduled_ts:
            sched.append(m.first_token_ts - m.scheduled_ts)
        if m is not None and m.first_token_latency:
            arrival.append(m.first_token_latency)
    hit = None
    if before and after and after[0] > before[0]:
        hit = (after[1] - before[1]) / (after[0] - before[0])
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return Run(tokens, secs, tokens / secs, pct_ms(sched, 0.5), pct_ms(sched, 0.95), pct_ms(arrival, 0.5),
               pct_ms(arrival, 0.95), hit, cache_reset)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m perf.peer.vllm_offline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", required=True, help="comma-separated workloads of perf/peer/rows.py, one engine's")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here (after every row)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--repeat", type=int, default=None, help="override every row's run count")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--model-root", type=Path, default=Path("/tmp/kvshare-peer-models"),
                    help="where the dummy model's config.json is written")
    ap.add_argument("--plan", action="store_true", help="print the engine's settings and the rows; import no vLLM")
    a = ap.parse_args(argv)
    try:
        a.row_list = rows_named(a.rows.split(","))
        if not a.row_list:
            raise ValueError("rows: none given")
        if len(vllm_engines(a.row_list)) != 1:
            raise ValueError(f"rows: {a.rows} need more than one engine; give one engine's rows "
                             "(same model, max_num_seqs, context)")
    except ValueError as exc:
        ap.error(str(exc))
    if a.repeat is not None:
        if a.repeat < 1:
            ap.error("--repeat must be >= 1")
        a.row_list = tuple(replace(r, repeat=a.repeat) for r in a.row_list)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    rows = a.row_list
    config = NAMED_CONFIGS[rows[0].model]
    path = model_dir(rows[0].model, a.dtype, a.model_root)
    kw = engine_kwargs(rows, path, a.dtype, a.gpu_memory_utilization)
    if a.plan:
        print(json.dumps({"engine": kw, "rows": [asdict(r) for r in rows]}, indent=1))
        return 0
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform   # NVML: no CUDA context in this front-end process

    t0 = time.perf_counter()
    llm = LLM(**kw)
    init_s = time.perf_counter() - t0
    cfg = llm.llm_engine.vllm_config
    engine = dict(init_s=round(init_s, 1), vllm=vllm.__version__, torch=torch.__version__,
                  device=current_platform.get_device_name(),
                  prefix_caching=cfg.cache_config.enable_prefix_caching,
                  max_num_seqs=cfg.scheduler_config.max_num_seqs,
                  max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
                  max_model_len=cfg.model_config.max_model_len, block_size=cfg.cache_config.block_size,
                  num_gpu_blocks=cfg.cache_config.num_gpu_blocks,
                  cudagraph_mode=str(getattr(cfg.compilation_config, "cudagraph_mode", "?")))
    print(f"== vLLM engine up in {init_s:.1f} s: {json.dumps(engine)}", flush=True)
    system = f"vllm-{vllm.__version__}"
    records: list[dict[str, Any]] = []
    for row in rows:
        timed, warm, outs = token_prompts(row, config.vocab_size)
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False) for n in outs]
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in warm],
                     SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0, detokenize=False), use_tqdm=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in timed]
        runs = []
        for i in range(row.repeat):
            run = timed_run(llm, prompts, params)
            runs.append(run)
            print(f"   {row.workload} run {i + 1}/{row.repeat}: {run.output_tokens} tokens in {run.seconds:.2f} s, "
                  f"{run.tok_per_s:,.1f} tok/s, TTFT p50 sched {run.ttft_sched_p50_ms} / arrival "
                  f"{run.ttft_arrival_p50_ms} ms, prefix hit {run.prefix_hit_rate}, cache reset {run.cache_reset}",
                  flush=True)
        rec = row_record(row, runs, system, engine)
        rec["expected_output_tokens"] = sum(outs)
        records.append(rec)
        print(f"{row.workload:<14} {system} C={row.max_num_seqs} reqs {row.requests} {rec['tok_per_s']:,.1f} tok/s "
              f"(median of {len(runs)}), TTFT p50 {rec['ttft_p50_ms']} ms ({rec['ttft_basis']})", flush=True)
        if rec["output_tokens"] != sum(outs):
            print(f"   WARNING: {rec['output_tokens']} output tokens, expected {sum(outs)}", flush=True)
        if a.json:   # after every row: a run cut short keeps what it measured
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(records, indent=1) + "\n")
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
