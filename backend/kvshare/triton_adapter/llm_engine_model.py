"""Triton adapter of the `llm_engine` model: a decoupled Python model that hosts one LLMEngine.

Thin by design: parse and validate inputs, hand the request to the engine thread, let the
response pump stream the outputs back. The engine, its page pool and its weights live for the
life of the server process.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import threading

import triton_python_backend_utils as pb_utils

from ..engine.data_parallel import EngineGroup, EngineTick, ParallelConfig, build_engines
from ..engine.engine import LLMEngine
from ..engine.engine_config import EngineConfig
from ..engine.engine_loop import Submission
from ..engine.faults import FaultInjector
from ..engine.gc_tuning import freeze_startup_heap
from ..engine.outputs import InvalidRequest
from ..engine.process_group import EngineProcessGroup, EngineUnavailable
from .cpu_threads import cores, server_step_threads
from .inputs import GenerationRequest, generation_requests
from .logs import configure_logging
from .metrics import EngineMetrics, MetricFamilies, RouterMetrics
from .response_stream import ClientStream, Reply, ResponsePump, error_response, overloaded_response
from .serving_probe import HttpReadiness, http_endpoint, tritonserver_args
from .word_lists import resolve_words

log = logging.getLogger("kvshare.triton")


def engine_config_from(model_config: dict, instance_kind: str, device_id: str) -> EngineConfig:
    """Triton config parameters, overridden by KVSHARE_<NAME> environment variables."""
    parallel = ParallelConfig.field_names()
    values = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items() if k not in parallel}
    for field in EngineConfig.__dataclass_fields__:
        env = os.environ.get(f"KVSHARE_{field.upper()}")
        if env is not None:
            values[field] = env
    if "device" not in values:
        values["device"] = f"cuda:{device_id}" if instance_kind == "GPU" else "cpu"
    return EngineConfig.from_mapping(values)


def parallel_config_from(model_config: dict) -> ParallelConfig:
    """How many engines this instance drives and how requests reach them (ParallelConfig's fields),
    from the same parameters and KVSHARE_<NAME> variables."""
    names = ParallelConfig.field_names()
    values = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items() if k in names}
    for name in names:
        env = os.environ.get(f"KVSHARE_{name.upper()}")
        if env is not None:
            values[name] = env
    return ParallelConfig.from_mapping(values)


class MetricsPublisher:
    """Publishes the engine's metrics from its own thread.

    Every gauge set, counter increment and histogram observation is an IPC round trip to the Triton
    process (~15-30 µs), and the latency histograms take one observation per generated token. Done
    on the engine thread, each 0.5 s tick stalled the steps for ~120 ms at 8.7k tok/s on the CPU
    proxy (41% of the engine thread's time; docs/develop/engine.md). The engine thread now only hands
    over a snapshot; snapshots that arrive while one is being published merge (latest stats, all
    latency samples), so no sample is lost and the engine never waits.
    """

    def __init__(self, metrics: EngineMetrics):
        self._metrics = metrics
        self._lock = threading.Lock()
        self._stats = None
        self._ttft: list[list[float]] = []
        self._itl: list[list[float]] = []
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvshare-metrics", daemon=True)
        self._thread.start()

    def offer(self, stats, ttft: list[float], itl: list[float]) -> None:
        """Called on the engine thread: O(1), no IPC."""
        with self._lock:
            self._stats = stats
            if ttft:
                self._ttft.append(ttft)
            if itl:
                self._itl.append(itl)
        self._wake.set()

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            closing = self._closing      # read before taking: what was offered before close() goes out
            with self._lock:
                stats, ttft, itl = self._stats, self._ttft, self._itl
                self._stats, self._ttft, self._itl = None, [], []
            if stats is not None:
                try:
                    self._metrics.update(stats, [v for part in ttft for v in part], [v for part in itl for v in part])
                except Exception:
                    log.exception("publishing metrics failed")
            if closing:
                return


class LLMEngineModel:
    def initialize(self, args):
        configure_logging()
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("llm_engine must be decoupled (model_transaction_policy)")
        config = engine_config_from(model_config, args.get("model_instance_kind", "CPU"),
                                    args.get("model_instance_device_id", "0"))
        if config.stream_interval < 1:
            raise pb_utils.TritonModelException(f"stream_interval must be >= 1, got {config.stream_interval}")
        if not config.step_log_interval_s >= 0:
            raise pb_utils.TritonModelException(f"step_log_interval_s must be >= 0 (0: no step log), "
                                                f"got {config.step_log_interval_s}")
        parallel = parallel_config_from(model_config)
        step_threads = None
        if config.device == "cpu":
            import torch

            step_threads = server_step_threads(os.environ, min(torch.get_num_threads(), cores()))
            if step_threads is not None:
                torch.set_num_threads(step_threads.decode)
                log.info("CPU engine: %d torch threads for decode steps, %d for steps with a prompt, of %d cores "
                         "(by default every core up to two, else decode leaves one to the server's own threads; "
                         "KVSHARE_CPU_THREADS, KVSHARE_CPU_PREFILL_THREADS or OMP_NUM_THREADS set them)",
                         step_threads.decode, step_threads.prefill, cores())
            else:
                log.info("CPU engine: %d torch threads of %d cores (OMP_NUM_THREADS)", torch.get_num_threads(), cores())
        log.info("starting the kvshare engine: %s (overlap scheduling %s; %s; code in %s)", config,
                 "on" if config.overlap_enabled else "off", parallel, os.path.dirname(os.path.dirname(__file__)))
        faults = FaultInjector.from_environment(os.environ)
        if faults is not None:
            log.warning("FAULT INJECTION IS ON (tests only): %s", faults.spec)
        self.model_name = model_name = args.get("model_name", "llm_engine")
        families = MetricFamilies(pb_utils)
        n = parallel.data_parallel_size
        self.publishers = [MetricsPublisher(EngineMetrics(pb_utils, model_name, i, families)) for i in range(n)]
        self.router_metrics = RouterMetrics(families, model_name) if n > 1 else None
        on_route = (lambda d: self.router_metrics.record(d.engine, d.reason)) if n > 1 else None
        self.pump = ResponsePump(pb_utils, stream_interval=config.stream_interval,
                                 on_abandoned=lambda rid: self.group.abandon(rid), faults=faults)
        # Triton finalizes a model only once every response factory is released, i.e. after every
        # request in flight has ended: on a shutdown or an unload the engine must end them itself,
        # and this is how it learns of one (nothing reaches the stub). Not asked before the first
        # execute(): while the model loads, it reads unready.
        self._executing = False
        endpoint = http_endpoint(tritonserver_args(os.getppid()))
        self._readiness = HttpReadiness(endpoint, model_name) if endpoint is not None else None
        if self._readiness is None:
            log.warning("tritonserver's HTTP endpoint is off: on a shutdown or an unload the requests in "
                        "flight run to their end, up to --exit-timeout-secs")
        serving = self._serving if self._readiness is not None else None
        if parallel.engine_process == "on":
            try:
                self.group = EngineProcessGroup.start(
                    config, parallel, step_threads, max_in_flight=config.max_queued_requests * n,
                    on_tick=self._publish_metrics, on_route=on_route, serving=serving)
            except EngineUnavailable as exc:
                raise pb_utils.TritonModelException(str(exc)) from None
            ready = self.group.ready
            self.config, self.limits, self.tokenizer = ready.config, ready.limits, ready.tokenizer
            where = f"engine process {ready.pid}: {', '.join(ready.devices)}"
            pages, page_size = ready.num_pages, ready.page_size
        else:
            engines = (build_engines(config, parallel, faults=faults) if n > 1
                       else [LLMEngine(config, faults=faults, step_threads=step_threads)])
            first = engines[0]
            self.config, self.limits, self.tokenizer = first.config, first.limits, first.tokenizer
            self.group = EngineGroup(engines, parallel.router_settings, max_in_flight=config.max_queued_requests,
                                     on_tick=self._publish_metrics, faults=faults, serving=serving, on_route=on_route)
            where = "this stub: " + ", ".join(str(e.device) for e in engines)
            pages, page_size = first.kv.num_pages, first.kv.page_size
        self._ids = itertools.count()
        freeze_startup_heap()
        log.info("kvshare engine ready: %d engine(s) in %s; %d KV pages of %d tokens each; shutdown probe %s",
                 n, where, pages, page_size, self._readiness)

    def _serving(self) -> bool | None:
        """Does the server still serve this model? None: cannot tell (yet)."""
        return self._readiness() if self._executing else None

    def _publish_metrics(self, tick: EngineTick) -> None:
        """on_tick: on the engine's thread, or the engine process's reader thread."""
        self.publishers[tick.engine].offer(tick.stats, tick.ttft, tick.itl)

    def execute(self, requests):
        if not self._executing:
            self._executing = True
            if self._readiness is not None:
                self._readiness.serving_seen()
        for request in requests:
            sender = request.get_response_sender()
            # One pass over the inputs: get_input_tensor_by_name rebuilds the whole input list on each
            # of the ~20 lookups, all under the GIL that the engine thread needs.
            tensors = {t.name(): t for t in request.inputs()}
            get = lambda name, ts=tensors: _as_numpy(ts.get(name))
            cancel_key = get("cancel_request_key")
            if cancel_key is not None:
                # A control request from llm_bls: its client cancelled (Triton 2.51 has no BLS cancel).
                self.group.cancel(_keyed_id(cancel_key))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            try:
                rows = [resolve_words(r, self.tokenizer)
                        for r in generation_requests(get, default_max_tokens=self.config.default_max_tokens)]
                for row in rows:
                    self.limits.validate(row.prompt_ids, row.params)
            except InvalidRequest as exc:
                sender.send(error_response(pb_utils, str(exc)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            key = get("request_key")
            base_id = _keyed_id(key) if key is not None else f"{request.request_id() or 'req'}#{next(self._ids)}"
            log.debug("llm_engine: request %s arrived (%d row(s))", base_id, len(rows))
            self._submit(base_id, rows, sender, _timeout_s(request), frozenset(request.requested_output_names()))
        return None

    def _submit(self, base_id: str, rows: list[GenerationRequest], sender, timeout_s: float | None,
                requested: frozenset[str] = frozenset()) -> None:
        """One engine request per row and sequence: num_return_sequences n > 1 forks n - 1 of them
        from the first (one prefill); a beam search is one engine request. All or none go in."""
        members = []
        for row in rows:
            n = row.num_return_sequences if row.params.beam_width == 1 else 1
            first = None
            for s in range(n):
                rid = base_id if len(rows) == 1 and n == 1 else f"{base_id}/{row.batch_index}.{s}"
                members.append((rid, row, s, first))
                first = first or rid
        reply = Reply(len(members)) if len(members) > 1 else None
        # The prompt is echoed only in a whole (non-streamed) answer, as TensorRT-LLM does.
        subs = [Submission(rid, row.prompt_ids, _engine_params(row), row.cache_salt,
                           not row.exclude_input_in_output and not row.stream, None,
                           sender.is_cancelled, batch_sink=self.pump.put_many, fork_of=parent, timeout_s=timeout_s)
                for rid, row, _, parent in members]
        for rid, row, s, _ in members:
            self.pump.register(rid, ClientStream(sender, row, sequence_index=s, reply=reply, requested=requested))
        try:
            accepted = self.group.try_submit_all(base_id, subs)
            refusal = None if accepted else overloaded_response(pb_utils, self.group.in_flight,
                                                                self.group.max_in_flight)
        except EngineUnavailable as exc:
            refusal = error_response(pb_utils, str(exc))
        if refusal is not None:
            for rid, *_ in members:
                self.pump.forget(rid)
            sender.send(refusal, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        log.info("kvshare engine shutting down: %d responses sent for %d tokens", self.pump.responses_sent,
                 self.pump.tokens_sent)
        self.group.shutdown()     # each engine closes after its loop: disk writes in flight land, so a restart finds them
        self.pump.close()
        for publisher in self.publishers:
            publisher.close()
        log.info("kvshare engine stopped")


def _engine_params(row: GenerationRequest):
    """Perf metrics go out on every response (TRT-LLM's clients read them on each): the engine then
    attaches the request's timing to every output, not only the last."""
    return dataclasses.replace(row.params, return_timing=True) if row.return_perf_metrics else row.params


def _keyed_id(key) -> str:
    raw = key.reshape(-1)[0]
    return "key:" + (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw))


def _as_numpy(tensor):
    return None if tensor is None else tensor.as_numpy()


def _timeout_s(request) -> float | None:
    """The request's Triton timeout (the client's `timeout`, in µs; 0 = none), as seconds. Triton 2.51
    enforces it only in a dynamic batcher's queue, which a decoupled engine model has not: the
    engine enforces it, over the request's whole life (queued and running)."""
    micros = request.timeout()
    return micros / 1e6 if micros else None
