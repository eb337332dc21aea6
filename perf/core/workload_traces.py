"""Seeded synthetic token-id traces for the workloads of /work/shared/benchmarks.md.

No tokenizer: token ids are drawn from a 32000-id vocabulary, so two prompts share a prefix only
where the workload says they do. Output lengths are forced (the replay ignores EOS), as in the
benchmarks. Closed-loop traces keep `concurrency` requests in flight; `mixed` is open-loop with
Poisson arrivals (arrival_s).

    python perf/core/workload_traces.py        # prints one line per workload
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

VOCAB = 32_000
DEFAULT_SEED = 0


@dataclass(frozen=True)
class Request:
    request_id: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float = 0.0
    salt: bytes = b""


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[Request, ...]
    concurrency: int | None  # closed loop: requests kept in flight; None: open loop on arrival_s
    description: str


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def _requests(prompts: list[tuple[int, ...]], output: int | list[int], arrivals: list[float] | None = None):
    outputs = output if isinstance(output, list) else [output] * len(prompts)
    times = arrivals or [0.0] * len(prompts)
    return tuple(Request(i, p, o, t) for i, (p, o, t) in enumerate(zip(prompts, outputs, times)))


def seed_12x128(seed: int = DEFAULT_SEED, num_requests: int = 96) -> Trace:
    rng = random.Random(seed)
    prompts = [_tokens(rng, 128) for _ in range(num_requests)]
    return Trace("seed-12x128", _requests(prompts, 128), 12, "12 concurrent, 128 distinct / 128 out")


def seed_hot10(seed: int = DEFAULT_SEED, num_requests: int = 240, hot_share: float = 0.68) -> Trace:
    """68% of requests reuse one of 10 hot ~128-token prompts (Zipf 1/rank among them); the rest are unique."""
    rng = random.Random(seed)
    hot = [_tokens(rng, rng.randint(120, 136)) for _ in range(10)]
    weights = [1 / rank for rank in range(1, 11)]
    prompts = []
    for _ in range(num_requests):
        if rng.random() < hot_share:
            prompts.append(rng.choices(hot, weights)[0])
        else:
            prompts.append(_tokens(rng, rng.randint(120, 136)))
    return Trace("seed-hot10", _requests(prompts, 128), 12, "12 concurrent, 68% on 10 hot ~128-token prompts")


def seed_long(seed: int = DEFAULT_SEED, num_requests: int = 48) -> Trace:
    rng = random.Random(seed)
    prompts = [_tokens(rng, 1024) for _ in range(num_requests)]
    return Trace("seed-long", _requests(prompts, 128), 12, "12 concurrent, 1024 distinct / 128 out")


def seed_long_32k(seed: int = DEFAULT_SEED, num_requests: int = 8, prompt_tokens: int = 32_768,
                  output_tokens: int = 256) -> Trace:
    """Long-context prefill and decode: every request in flight at once, each reading a 32k-token
    context; meant for a model with a 128k window (the Llama-3-8B shape as Llama-3.1-8B)."""
    rng = random.Random(seed)
    prompts = [_tokens(rng, prompt_tokens) for _ in range(num_requests)]
    return Trace("seed-long-32k", _requests(prompts, output_tokens), num_requests,
                 f"{num_requests} concurrent, {prompt_tokens} distinct / {output_tokens} out")


def fixed_b(batch: int, seed: int = DEFAULT_SEED) -> Trace:
    rng = random.Random(seed)
    prompts = [_tokens(rng, 128) for _ in range(max(2 * batch, 8))]
    return Trace(f"fixed-{batch}", _requests(prompts, 128), batch, f"{batch} concurrent, 128 distinct / 128 out")


def shared_prefix(seed: int = DEFAULT_SEED, groups: int = 64, per_group: int = 16, concurrency: int = 64) -> Trace:
    """SGLang generated-shared-prefix: a 2048-token system prompt per group + a 128-token question."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = _tokens(rng, 2048)
        prompts += [system + _tokens(rng, 128) for _ in range(per_group)]
    rng.shuffle(prompts)
    return Trace("shared-prefix", _requests(prompts, 256), concurrency,
                 f"{groups} groups x {per_group}: 2048 shared + 128 / 256 out, {concurrency} concurrent")


def prefix_repetition(seed: int = DEFAULT_SEED, num_requests: int = 200, concurrency: int = 16) -> Trace:
    """vLLM prefix_repetition: 10 prefixes of 256 tokens, each request adds a unique 256-token suffix."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, 256) for _ in range(10)]
    prompts = [rng.choice(prefixes) + _tokens(rng, 256) for _ in range(num_requests)]
    return Trace("prefix-repetition", _requests(prompts, 128), concurrency,
                 f"10 prefixes x 256 + 256 unique / 128 out, {concurrency} concurrent")


def mixed(seed: int = DEFAULT_SEED, num_requests: int = 200, rate_per_s: float = 8.0) -> Trace:
    """Poisson arrivals; ShareGPT-like lognormal lengths (mean ~200 in / ~180 out, clipped to 4..2048)."""
    rng = random.Random(seed)

    def lognormal(mean: float, sigma: float) -> int:
        mu = math.log(mean) - sigma**2 / 2
        return max(4, min(2048, round(rng.lognormvariate(mu, sigma))))

    clock, arrivals, prompts, outputs = 0.0, [], [], []
    for _ in range(num_requests):
        clock += rng.expovariate(rate_per_s)
        arrivals.append(clock)
        prompts.append(_tokens(rng, lognormal(200, 0.9)))
        outputs.append(lognormal(180, 0.8))
    return Trace("mixed", _requests(prompts, outputs, arrivals), None,
                 f"Poisson {rate_per_s}/s, lognormal ~200 in / ~180 out")


TRACES: dict[str, Callable[[], Trace]] = {
    "seed-12x128": seed_12x128,
    "seed-hot10": seed_hot10,
    "seed-long": seed_long,
    "seed-long-32k": seed_long_32k,
    "fixed-1": lambda: fixed_b(1),
    "fixed-64": lambda: fixed_b(64),
    "fixed-256": lambda: fixed_b(256),
    "shared-prefix": shared_prefix,
    "prefix-repetition": prefix_repetition,
    "mixed": mixed,
    # serving points long enough for a steady state; its first 200 requests are mixed's
    "mixed-1k": lambda: mixed(num_requests=1000),
}


def make_trace(name: str) -> Trace:
    try:
        return TRACES[name]()
    except KeyError:
        raise ValueError(f"unknown trace {name!r}; choose one of {', '.join(TRACES)}") from None


def reusable_share(trace: Trace, page_size: int = 16) -> float:
    """Share of prompt tokens in full pages an earlier prompt already had (infinite cache, no cap)."""
    seen: set[int] = set()
    reused = total = 0
    for request in trace.requests:
        key = 0
        prompt = request.prompt_ids
        total += len(prompt)
        for start in range(0, len(prompt) - page_size + 1, page_size):
            key = hash((key, prompt[start : start + page_size]))
            if key in seen:
                reused += page_size
            seen.add(key)
    return reused / total if total else 0.0


def main() -> None:
    print(f"{'trace':<18} {'reqs':>5} {'conc':>5} {'prompt mean':>11} {'min':>5} {'max':>5} "
          f"{'out mean':>8} {'reusable':>8}  description")
    for name in TRACES:
        trace = make_trace(name)
        prompts = [len(r.prompt_ids) for r in trace.requests]
        outputs = [r.max_new_tokens for r in trace.requests]
        concurrency = str(trace.concurrency) if trace.concurrency else "open"
        print(f"{name:<18} {len(prompts):>5} {concurrency:>5} {sum(prompts) / len(prompts):>11.1f} "
              f"{min(prompts):>5} {max(prompts):>5} {sum(outputs) / len(outputs):>8.1f} "
              f"{reusable_share(trace):>8.1%}  {trace.description}")
    print("reusable: prompt tokens in 16-token pages an earlier request already had (infinite cache)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
