"""Shared pieces of the full-stack run (perf/server/fullstack.sh): the workload, metric snapshots.

The workload is the offline benchmark's `fixed-<C>` shape (perf/core/workload_traces.py): distinct
random prompts of `input_len` ids, exactly `output_len` new tokens each (EOS ignored, greedy), `C`
requests in flight (closed loop). Prompts come from the same seeded generator as `fixed_b`, so with
128 requests of 128 ids they ARE fixed-64's prompts; more requests continue the same sequence.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from perf.core import workload_traces as wt  # noqa: E402

# Server counters/gauges read around each run (perf/report/metrics_sampler.py's names).
COUNTERS = {
    "generation_tokens": "kvshare_generation_tokens_total",
    "prompt_tokens": "kvshare_prompt_tokens_total",
    "prefix_query_tokens": "kvshare_prefix_cache_queries_tokens_total",
    "prefix_hit_tokens": "kvshare_prefix_cache_hits_tokens_total",
    "preemptions": "kvshare_preemptions_total",
    "evictions": "kvshare_kv_evictions_total",
}
GAUGES = {"running": "kvshare_requests_running", "waiting": "kvshare_requests_waiting"}


def prompts(n: int, input_len: int, vocab: int, seed: int = wt.DEFAULT_SEED) -> list[tuple[int, ...]]:
    """`n` distinct prompts drawn as workload_traces.fixed_b draws them, folded into the model's vocabulary."""
    import random

    rng = random.Random(seed)
    return [tuple(t % vocab for t in wt._tokens(rng, input_len)) for _ in range(n)]


def make_trace(name: str, n: int, concurrency: int, input_len: int, output_len: int, vocab: int,
               seed: int = wt.DEFAULT_SEED) -> "wt.Trace":
    reqs = tuple(wt.Request(i, p, output_len) for i, p in enumerate(prompts(n, input_len, vocab, seed)))
    return wt.Trace(name, reqs, concurrency,
                    f"{concurrency} concurrent, {n} distinct {input_len} ids / {output_len} out")


def request_fields(prompt: Sequence[int], output_len: int, cache_salt: Optional[str] = None) -> dict[str, Any]:
    """What goes on the wire for one request (kvshare_client.GenerationRequest fields).

    Same sampling as perf/engine/offline_benchmark.py: greedy, exactly output_len tokens (ignore_eos).
    The cache salt keeps one run's prompts from hitting pages an earlier run left in the prefix
    cache (the ids stay the same); it does not change the work.
    """
    fields: dict[str, Any] = {"input_ids": list(prompt), "max_tokens": output_len, "ignore_eos": True,
                              "temperature": 0.0, "stream": True, "exclude_input_in_output": True}
    if cache_salt:
        fields["cache_salt"] = cache_salt
    return fields


# ------------------------------------------------------------------------------------------ metrics

def snapshot(metrics_url: str) -> dict[str, Optional[float]]:
    from kvshare_client.metrics import fetch_metrics, metric_total, parse_samples

    samples = parse_samples(fetch_metrics(metrics_url))
    out = {k: metric_total(samples, name) for k, name in COUNTERS.items()}
    out.update({k: metric_total(samples, name) for k, name in GAUGES.items()})
    out["time_s"] = time.time()
    return out


def quiet_snapshot(metrics_url: str, timeout_s: float = 30.0, interval_s: float = 0.25) -> dict[str, Optional[float]]:
    """A snapshot once the engine is idle (nothing running or waiting) and its token counter stopped
    moving for two scrapes: the counters are published by the engine thread a tick after a step."""
    deadline = time.monotonic() + timeout_s
    last = snapshot(metrics_url)
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        cur = snapshot(metrics_url)
        idle = not (cur.get("running") or cur.get("waiting"))
        if idle and cur.get("generation_tokens") == last.get("generation_tokens"):
            return cur
        last = cur
    last["not_quiet"] = 1.0
    return last


def delta(before: dict[str, Optional[float]], after: dict[str, Optional[float]], key: str) -> Optional[float]:
    a, b = before.get(key), after.get(key)
    return None if a is None or b is None else b - a


def counter_deltas(before: dict[str, Optional[float]], after: dict[str, Optional[float]]) -> dict[str, Optional[float]]:
    return {k: delta(before, after, k) for k in COUNTERS}


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1, default=str), encoding="utf-8")


def rate(tokens: Optional[float], seconds: Optional[float]) -> Optional[float]:
    return None if tokens is None or not seconds else tokens / seconds
