"""Locust users that stream completions from kvshare over gRPC (load tests, issue 5).

Import this module from a locustfile only: importing locust monkey-patches the standard library
with gevent, and gRPC must then be switched to gevent before any channel exists.

Each user owns one ``RawStreamSession`` (one channel, one long-lived gRPC stream) and runs a
closed loop: send a request, read its stream to the end, send the next. Every completion fires
Locust request events, all named after the model:

    type "stream"  response_time = end-to-end latency (ms), response_length = output tokens,
                   exception set on failure -> this row is the request count and failure ratio
    type "ttft"    time to first token (ms), successful requests only
    type "itl"     mean inter-token latency of the request (ms), requests with >= 2 tokens

Options (``locust --help`` lists them under "kvshare"): --kvshare-model, --kvshare-workload,
--kvshare-synthetic-input-len, --kvshare-max-tokens, --kvshare-min-tokens, --kvshare-ignore-eos,
--kvshare-temperature,
--kvshare-chat, --kvshare-no-stream, --kvshare-cache-salt, --kvshare-stream-timeout and the SLO
gates --kvshare-slo-max-failure-ratio / --kvshare-slo-p95-ttft-ms, checked when Locust quits;
a violated gate sets the process exit code to 1.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Optional

import locust  # noqa: F401  (first: gevent monkey-patching happens on this import)
from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()

from locust import User, constant, events, task  # noqa: E402
from locust.env import Environment  # noqa: E402
from locust.runners import WorkerRunner  # noqa: E402

from .raw_stream import RawStreamSession  # noqa: E402
from .slo import SloGates, evaluate  # noqa: E402
from .types import TEXT_MODEL, TOKEN_MODEL, Completion, GenerationRequest  # noqa: E402
from .wire import build_tensors  # noqa: E402
from .workload import DEFAULT_PROMPTS, RoundRobin, load_workload, synthetic_token_requests  # noqa: E402

log = logging.getLogger("kvshare.locust")

STREAM_TYPE, TTFT_TYPE, ITL_TYPE = "stream", "ttft", "itl"


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    g = parser.add_argument_group("kvshare", "kvshare gRPC streaming load (host = gRPC address, e.g. 127.0.0.1:8001)")
    g.add_argument("--kvshare-model", default=TEXT_MODEL, help="ensemble (text) or llm_engine (token ids)")
    g.add_argument(
        "--kvshare-workload", default="", help="workload file (.jsonl/.json/.txt); default: built-in prompts"
    )
    g.add_argument(
        "--kvshare-synthetic-input-len",
        type=int,
        default=128,
        help="llm_engine without a workload: random prompts of this many token ids",
    )
    g.add_argument("--kvshare-max-tokens", type=int, default=64)
    g.add_argument(
        "--kvshare-min-tokens",
        type=int,
        default=None,
        help="force output lengths (EOS ignored until then); e.g. equal to --kvshare-max-tokens",
    )
    g.add_argument(
        "--kvshare-ignore-eos",
        action="store_true",
        default=False,
        help="ignore_eos=true: every request generates --kvshare-max-tokens tokens",
    )
    g.add_argument("--kvshare-temperature", type=float, default=None)
    g.add_argument("--kvshare-chat", action="store_true", default=False, help="apply_chat_template=true (ensemble)")
    g.add_argument("--kvshare-no-stream", action="store_true", default=False, help="one response per request")
    g.add_argument("--kvshare-cache-salt", default=None)
    g.add_argument("--kvshare-stream-timeout", type=float, default=300.0,
                   help="seconds each request may take to its final response")
    g.add_argument("--kvshare-slo-max-failure-ratio", type=float, default=0.0)
    g.add_argument("--kvshare-slo-p95-ttft-ms", type=float, default=None)


def grpc_target(host: Optional[str]) -> str:
    """Locust's --host as a gRPC target: 'grpc://h:p', 'http://h:p' or 'h:p' -> 'h:p'."""
    if not host:
        return "127.0.0.1:8001"
    return host.split("://", 1)[-1].rstrip("/")


def _overrides(opts: Any) -> dict[str, Any]:
    return {
        "max_tokens": opts.kvshare_max_tokens,
        "min_tokens": opts.kvshare_min_tokens,
        "temperature": opts.kvshare_temperature,
        "stream": not opts.kvshare_no_stream,
        "cache_salt": opts.kvshare_cache_salt,
        "apply_chat_template": True if opts.kvshare_chat else None,
        "ignore_eos": True if opts.kvshare_ignore_eos else None,
    }


_workloads: dict[tuple, tuple[GenerationRequest, ...]] = {}


def workload_for(opts: Any) -> tuple[GenerationRequest, ...]:
    """Requests for this process, loaded once and shared by all its users."""
    key = (opts.kvshare_model, opts.kvshare_workload, opts.kvshare_synthetic_input_len, tuple(_overrides(opts).items()))
    if key not in _workloads:
        overrides = _overrides(opts)
        if opts.kvshare_workload:
            _workloads[key] = load_workload(opts.kvshare_workload, overrides)
        elif opts.kvshare_model == TOKEN_MODEL:
            overrides.pop("apply_chat_template")
            _workloads[key] = synthetic_token_requests(64, opts.kvshare_synthetic_input_len, overrides=overrides)
        else:
            _workloads[key] = tuple(
                GenerationRequest(prompt=p, **{k: v for k, v in overrides.items() if v is not None})
                for p in DEFAULT_PROMPTS
            )
    return _workloads[key]


def fire_completion_events(env: Environment, name: str, completion: Completion, start_time: float) -> None:
    """One Locust request event per stream (end to end, with its tokens), plus TTFT and ITL rows."""
    rows = [(STREAM_TYPE, completion.e2e_s, completion.output_tokens or 0),
            (TTFT_TYPE, completion.ttft_s, 0), (ITL_TYPE, completion.itl_s, 0)]
    for request_type, seconds, length in rows:
        if seconds is not None:
            env.events.request.fire(request_type=request_type, name=name, response_time=seconds * 1e3,
                                    response_length=length, exception=None, context={}, start_time=start_time)


class KvshareGrpcUser(User):
    """Closed-loop streaming user; subclass it in a locustfile (set ``model`` to pin one)."""

    abstract = True
    wait_time = constant(0)
    model: Optional[str] = None  # None: --kvshare-model

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.model_name = self.model or (opts.kvshare_model if opts else TEXT_MODEL)
        self.session = RawStreamSession(
            grpc_target(self.host), stream_timeout=opts.kvshare_stream_timeout if opts else None
        )
        requests = workload_for(opts)
        self.requests = RoundRobin(requests, start=random.randrange(len(requests)))

    def on_stop(self) -> None:
        self.session.close()

    @task
    def complete(self) -> None:
        self.run_request(self.requests.next())

    def run_request(self, request: GenerationRequest) -> Optional[Completion]:
        """Stream one request and report it; returns None on failure (already reported)."""
        start_time = time.time()
        t0 = time.perf_counter()
        try:
            completion = self.session.generate(self.model_name, build_tensors(request))
        except Exception as exc:  # reported as a failure, never kills the user
            self.environment.events.request.fire(
                request_type=STREAM_TYPE,
                name=self.model_name,
                response_time=(time.perf_counter() - t0) * 1e3,
                response_length=0,
                exception=exc,
                context={},
                start_time=start_time,
            )
            return None
        fire_completion_events(self.environment, self.model_name, completion, start_time)
        return completion


def stream_stats(env: Environment) -> tuple[int, int, Optional[float], int]:
    """(requests, failures, p95 TTFT ms, output tokens) over all models' rows."""
    requests = failures = tokens = 0
    p95: Optional[float] = None
    for (_, method), entry in env.stats.entries.items():
        if method == STREAM_TYPE:
            requests += entry.num_requests
            failures += entry.num_failures
            tokens += entry.total_content_length
        elif method == TTFT_TYPE and entry.num_requests:
            v = float(entry.get_response_time_percentile(0.95))
            p95 = v if p95 is None else max(p95, v)
    return requests, failures, p95, tokens


@events.quitting.add_listener
def _check_slo(environment: Environment, **_: Any) -> None:
    opts = environment.parsed_options
    if opts is None or isinstance(environment.runner, WorkerRunner):
        return  # workers hold partial stats; the master judges
    requests, failures, p95, tokens = stream_stats(environment)
    total = environment.stats.total
    seconds = max((total.last_request_timestamp or 0) - total.start_time, 1e-9)
    log.info("kvshare: %d output tokens in %.1fs (%.1f tok/s)", tokens, seconds, tokens / seconds)
    report = evaluate(
        requests, failures, p95, SloGates(opts.kvshare_slo_max_failure_ratio, opts.kvshare_slo_p95_ttft_ms)
    )
    (log.info if report.ok else log.error)("kvshare: %s", report.summary())
    environment.process_exit_code = 0 if report.ok else 1
