"""The LLM engine: requests in, token/text deltas out, one continuous-batching step at a time.

    schedule (kvshare.core)  ->  copy pages + forward + sample (kvshare.runtime)  ->  detokenize, stop, finish

Single-threaded by design: EngineLoop owns it on one thread; nothing here locks.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from ..core.disk_tier import DiskTier, IndexedPage
from ..core.host_tier import HostTier
from ..core.kv_cache_manager import KVCacheManager
from ..core.scheduler import Scheduler
from ..core.types import PoolStats, StepPlan
from ..runtime.cascade_planner import CascadePolicy
from ..runtime.cuda_graph_runner import graph_batch_sizes, kernel_debug
from ..runtime.disk_io import DiskIO
from ..runtime.disk_store import DiskStore, layout_fingerprint
from ..runtime.kv_cache import KVCache, kv_storage_dtype, pages_for_memory
from ..runtime.llama import LlamaModel
from ..runtime.mixed_graph_runner import mixed_graph_sizes
from ..runtime.model_runner import ChunkInput, LaunchedStep, ModelRunner, future_ref
from ..runtime.sampler import Sampler, SamplingRow
from ..runtime.step_threads import StepThreads
from ..runtime.weights import LoadedModel, load_model
from ..sampling_params import SamplingParams
from .beam_search import BeamSearch
from .detokenizer import IncrementalDetokenizer
from .engine_config import EngineConfig
from .faults import FaultInjector
from .limits import EngineLimits
from .model_dtypes import MODEL_DTYPES
from .outputs import Beam, InvalidRequest, RequestOutput, RequestTiming, StepShape
from .request_state import RequestState
from .tensor_parallel_ranks import TensorParallelRanks, build_rank_model

log = logging.getLogger("kvshare.engine")

_NO_EXTRAS: dict = {}      # a plain token's output asks for nothing more: no dict per token (never written)


@dataclass(frozen=True)
class _PendingStep:
    seq_ids: tuple[int, ...]          # sampling rows in order
    rows: dict[int, int]              # seq id -> row of its id in the launched step
    launched: LaunchedStep


@dataclass
class _BeamRequest:
    """A beam-search request in flight: its search and the one-token requests of the current step."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: str
    search: BeamSearch
    arrival: float
    step_ids: list[str]                         # the current step's requests, one per running beam
    results: dict[str, RequestOutput]           # their outputs as they finish
    first_scheduled_ns: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    cached_tokens: int = 0
    echo: str = ""                              # the prompt's text, before the best beam's (exclude_input_in_output=false)


@dataclass(frozen=True)
class EngineStats:
    pool: PoolStats
    requests_running: int
    requests_waiting: int
    prompt_tokens_total: int
    generation_tokens_total: int
    page_bytes: int = 0        # one page over all its tensors: tier page counters times this are bytes


CPU_WEIGHTS = ("blocks", "fp32")


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, *,
                 faults: FaultInjector | None = None, step_threads: StepThreads | None = None):
        if config.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(MODEL_DTYPES)}, got '{config.dtype}'")
        if config.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {config.tensor_parallel_size}")
        if config.tensor_parallel_size > 1:
            config = _tensor_parallel_config(config)
        self.config = config
        dtype = MODEL_DTYPES[config.dtype]
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)     # an unknown name fails before the model loads
        self.device = torch.device(config.device)
        if config.cpu_weights not in CPU_WEIGHTS:
            raise ValueError(f"cpu_weights must be one of {list(CPU_WEIGHTS)}, got '{config.cpu_weights}'")
        loaded = loaded or load_model(config.model, dtype=dtype, device=self.device, seed=config.seed,
                                      cpu_blocks=config.cpu_weights == "blocks")
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or loaded.config.max_position, loaded.config.max_position)
        num_pages = config.num_pages or pages_for_memory(
            loaded.config, page_size=config.page_size, dtype=kv_dtype, budget_bytes=int(config.kv_cache_memory_gb * 2**30))
        host_pages = 0
        if config.host_cache_memory_gb > 0 and config.enable_prefix_caching:
            host_pages = pages_for_memory(loaded.config, page_size=config.page_size, dtype=kv_dtype,
                                          budget_bytes=int(config.host_cache_memory_gb * 2**30))
        if config.disk_cache_dir and not host_pages:
            raise ValueError("disk_cache_dir needs host_cache_memory_gb > 0 (and prefix caching): disk pages "
                             "come back through host slots")
        self._tp = None       # tensor parallelism: the other ranks (engine/tensor_parallel_ranks.py)
        if config.tensor_parallel_size > 1:
            if config.kv_cache_dtype != "auto":
                raise ValueError("kv_cache_dtype must be 'auto' with tensor_parallel_size > 1 (8-bit pages are "
                                 f"single-rank for now), got '{config.kv_cache_dtype}'")
            self._tp = TensorParallelRanks.start(config, num_pages=num_pages, host_pages=host_pages,
                                                 max_model_len=self.max_model_len, loaded=loaded)
            model, self.kv = build_rank_model(loaded, self._tp.setup, 0, self._tp.group, self.device, dtype)
        else:
            self.kv = KVCache.allocate(loaded.config, num_pages=num_pages, page_size=config.page_size,
                                       dtype=kv_dtype, device=self.device, host_pages=host_pages)
            model = LlamaModel(loaded.config, loaded.weights, device=self.device, dtype=dtype)
        disk_tier, self.disk_io = self._open_disk_tier(config, loaded) if config.disk_cache_dir else (None, None)
        self.kv_release_window = release_window(config.kv_release_window, loaded.config)
        self.scheduler = Scheduler(
            KVCacheManager(num_pages, config.page_size, enable_prefix_caching=config.enable_prefix_caching,
                           policy=config.eviction, host_tier=HostTier(host_pages) if host_pages else None,
                           host_min_hits=config.host_cache_min_hits, disk_tier=disk_tier,
                           window=self.kv_release_window),
            max_running=config.max_running, max_step_tokens=config.max_step_tokens,
            max_prefill_chunk=config.max_prefill_chunk, debug_checks=config.debug_checks, admission=config.admission,
            admission_delay_steps=config.admission_delay_steps)
        self.eos_ids = frozenset(loaded.config.eos_token_ids)
        graphs = config.cuda_graphs and not kernel_debug()
        graph_sizes = graph_batch_sizes(config.max_running) if graphs else ()
        mixed_sizes = mixed_graph_sizes(config.mixed_graph_max_tokens, config.max_step_tokens) if graphs else ()
        # The cascade path only pays on the GPU (fewer KV bytes read); the CPU keeps one code path. Not
        # with released pages: it groups rows by their leading page ids, and released slots (-1) of
        # different requests would read as one shared prefix.
        cascade = (CascadePolicy() if config.cascade_attention and self.device.type == "cuda"
                   and not self.kv_release_window else None)
        self._faults = faults          # tests only (engine/faults.py): None in service
        sampler = Sampler(loaded.config.eos_token_ids, seed=config.seed)
        self.runner = ModelRunner(model, self.kv, faults.wrap("sample", sampler) if faults else sampler, self.device,
                                  max_model_len=self.max_model_len, graph_batch_sizes=graph_sizes,
                                  mixed_graph_tokens=mixed_sizes, cascade=cascade,
                                  max_rows=config.max_running, overlap=config.overlap_enabled,
                                  mirror=self._tp.mirror if self._tp is not None else None,
                                  step_threads=step_threads)
        self._pending: _PendingStep | None = None    # overlap scheduling: the launched, unresolved step
        self._seq_ids = itertools.count()
        self._by_request: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._beams: dict[str, _BeamRequest] = {}          # beam-search requests by their id
        self._beam_of: dict[str, _BeamRequest] = {}        # ... and by the ids of their step requests
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._last_plan: StepPlan | None = None    # what last_step describes (kept, not summarised per step)
        # RequestTiming is wall-clock ns (TensorRT-LLM's perf metrics); steps read the monotonic clock.
        self._wall_offset_ns = time.time_ns() - time.monotonic_ns()

    def _open_disk_tier(self, config: EngineConfig, loaded: LoadedModel) -> tuple[DiskTier, DiskIO]:
        """The disk tier's index (warm: the pages a previous server left in the directory) and worker."""
        if config.disk_cache_gb <= 0:
            raise ValueError(f"disk_cache_gb must be > 0 with a disk_cache_dir, got {config.disk_cache_gb}")
        model = config.model or "default"
        seed = f" seed={config.seed}" if model.startswith("dummy:") else ""   # a dummy's weights come from the seed
        fingerprint = layout_fingerprint(model, loaded.config, self.kv.host_page_tensors(), config.page_size,
                                         "blake2b_128", extra=f"dtype={config.dtype} kv={config.kv_cache_dtype}{seed}")
        store = DiskStore(config.disk_cache_dir, fingerprint)
        tier = DiskTier(max(1, int(config.disk_cache_gb * 2**30) // self.kv.host_page_bytes))
        found = tier.warm(IndexedPage(h.key, h.parent_key, h.salt, h.tokens) for h in store.scan())
        log.info("KV disk tier: %d pages (%.1f GiB) in %s, %d found from before, %s I/O", tier.num_pages,
                 config.disk_cache_gb, store.dir, found, store.io_library)
        return tier, DiskIO(store, self.kv.host_page_tensors())

    def _apply_disk_done(self) -> None:
        """Disk jobs finished since the last look: pages loadable, host slots reusable (engine thread)."""
        if self.disk_io is None:
            return
        kv = self.scheduler.kv
        for job, is_write, ok in self.disk_io.poll():
            if is_write:
                kv.on_disk_written(job, ok)
            else:
                kv.on_disk_read(job, ok)

    def close(self) -> None:
        """Finish the disk tier's writes (a restart finds them) and stop its workers; stop the
        tensor-parallel ranks. Idempotent."""
        if self.disk_io is not None:
            self.disk_io.close()
            self._apply_disk_done()
        if self._tp is not None:
            self._tp.close()

    # -- requests ---------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.kv.num_pages * self.kv.page_size

    @property
    def limits(self) -> EngineLimits:
        """What a request may ask of this engine: validation needs nothing else (an adapter in
        another process validates with this alone)."""
        capacity = self.capacity_tokens
        if self.scheduler.kv.max_pages_held(self.max_model_len) <= self.kv.num_pages:
            capacity = max(capacity, self.max_model_len)   # a window that fits the pool fits any length
        return EngineLimits(self.model_config.vocab_size, self.max_model_len, capacity,
                            self.config.max_prompt_tokens, self.config.max_beam_width,
                            self.config.max_logits_elements)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequest naming the field for anything this engine cannot serve."""
        self.limits.validate(prompt_ids, params)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    cache_salt: str = "", echo_prompt: bool = False, fork_of: str | None = None) -> None:
        """fork_of: a request in flight with the same prompt (num_return_sequences > 1): this one
        shares its prompt's pages instead of computing them (Scheduler.add)."""
        if request_id in self._by_request or request_id in self._beams:
            raise InvalidRequest("request_id", f"'{request_id}' is already in flight")
        self.validate(prompt_ids, params)
        if params.beam_width > 1:
            self._add_beam_request(request_id, prompt_ids, params, cache_salt, echo_prompt)
            return
        self._add(request_id, prompt_ids, params, cache_salt, echo_prompt, fork_of)
        self._prompt_tokens_total += len(prompt_ids)

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str,
             echo_prompt: bool = False, fork_of: str | None = None, internal: bool = False) -> RequestState:
        seq_id = next(self._seq_ids)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer is not None and not internal else None
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        echo = self.tokenizer.decode(prompt_ids, skip_special_tokens=True) if echo_prompt and self.tokenizer else ""
        state = RequestState(request_id, seq_id, list(prompt_ids), params, detok, gen, echo_prompt=echo,
                             end_ids=self._end_ids(params), internal=internal)
        self._by_request[request_id] = state
        self._by_seq[seq_id] = state
        if params.return_context_logits:
            # every prompt position must be computed for its logits: no page of another request serves it
            cache_salt = f"{cache_salt}\x00context-logits:{request_id}"
            fork_of = None
        parent = self._by_request.get(fork_of) if fork_of is not None else None
        self.scheduler.add(seq_id, state.prompt_ids, salt=cache_salt.encode(), max_new_tokens=params.max_tokens,
                           fork_of=parent.seq_id if parent is not None else None)
        return state

    # -- beam search (engine.beam_search: one one-token request per beam and step) ----------------
    def _add_beam_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, salt: str,
                          echo_prompt: bool = False) -> None:
        search = BeamSearch(params.beam_width, params.max_tokens, self._end_ids(params), length_penalty=params.length_penalty,
                            ignore_end=params.ignore_eos)
        run = _BeamRequest(request_id, list(prompt_ids), params, salt, search, time.monotonic(), [], {})
        if echo_prompt and self.tokenizer is not None:
            run.echo = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        self._beams[request_id] = run
        self._prompt_tokens_total += len(prompt_ids)
        self._launch_beam_step(run)

    def _end_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a request: its end_id when it sent one, else the model's EOS."""
        return frozenset(params.end_ids) if params.end_ids is not None else self.eos_ids

    def _launch_beam_step(self, run: _BeamRequest) -> None:
        step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=run.search.num_candidates, ignore_eos=True)
        run.step_ids, run.results = [], {}
        for j, beam in enumerate(run.search.running):
            sub_id = f"{run.request_id}\x1fbeam{run.search.steps}.{j}"
            self._add(sub_id, run.prompt_ids + list(beam.token_ids), step, run.salt, internal=True)
            run.step_ids.append(sub_id)
            self._beam_of[sub_id] = run

    def _route_beam_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Step requests' outputs feed their search; a search that ends gives its request's final output."""
        if not self._beam_of:
            return outputs
        kept = []
        for out in outputs:
            run = self._beam_of.pop(out.request_id, None) if out.finished else None
            if run is None:
                if out.request_id not in self._beam_of:
                    kept.append(out)
                continue
            run.results[out.request_id] = out
            if out.finish_reason == "error":
                kept.append(self._end_beam_request(run, "error", out.error))
            elif len(run.results) == len(run.step_ids):
                done = self._advance_beams(run)
                if done is not None:
                    kept.append(done)
        return kept

    def _advance_beams(self, run: _BeamRequest) -> RequestOutput | None:
        now = time.monotonic()
        if run.first_token_at is None:
            run.first_token_at = now
            first = run.results[run.step_ids[0]]
            run.cached_tokens = first.cached_tokens
            run.first_scheduled_ns = first.timing.first_scheduled_ns if first.timing else 0
            self._ttft.append(now - run.arrival)
        else:
            self._itl.append(now - run.last_token_at)
        run.last_token_at = now
        run.search.step([list(run.results[sid].top_logprobs[0]) for sid in run.step_ids])
        if run.search.done:
            return self._end_beam_request(run, None, None)
        self._launch_beam_step(run)
        return None

    def _end_beam_request(self, run: _BeamRequest, reason: str | None, error: str | None) -> RequestOutput:
        for sid in run.step_ids:                       # the step still running (cancel, error)
            self._beam_of.pop(sid, None)
            state = self._by_request.get(sid)
            if state is not None:
                self._finish(state, (), "", "cancelled", None)
        self._beams.pop(run.request_id, None)
        ends = run.search.end_ids

        def decode(ids: tuple[int, ...]) -> str:     # the end token is not part of the text
            if self.tokenizer is None:
                return ""
            return self.tokenizer.decode(list(ids[:-1] if ids and ids[-1] in ends else ids), skip_special_tokens=True)
        beams = tuple(Beam(h.beam.token_ids, decode(h.beam.token_ids), h.beam.cum_logprob, h.score, h.beam.logprobs)
                      for h in run.search.best(run.params.beam_width)) if reason is None else ()
        best = beams[0] if beams else None
        if reason is None:
            ended = best is not None and best.token_ids and best.token_ids[-1] in ends
            reason = "stop" if ended else "length"
        n_out = len(best.token_ids) if best else 0
        timing = self._timing_of(run.arrival, run.first_scheduled_ns, run.first_token_at, run.last_token_at,
                                 run.cached_tokens, len(run.prompt_ids), n_out)
        self._generation_tokens_total += n_out
        return RequestOutput(run.request_id, best.token_ids if best else (), run.echo + best.text if best else "", True, reason,
                             len(run.prompt_ids), n_out, run.cached_tokens, error,
                             logprobs=best.logprobs if best and run.params.logprobs >= 0 else (),
                             timing=timing, beams=beams)

    def abort(self, request_id: str, reason: str = "cancelled", error: str | None = None) -> RequestOutput | None:
        """Ends a request now (cancel, error, shutdown); its pages return to the pool."""
        run = self._beams.get(request_id)
        if run is not None:
            return self._end_beam_request(run, reason, error)
        state = self._by_request.get(request_id)
        if state is None or state.internal:
            return None
        return self._finish(state, (), "", reason, error)

    def abort_all(self, reason: str, error: str | None = None) -> list[RequestOutput]:
        """Ends every request (shutdown, or a step that raised: its half-done plan is dropped too)."""
        outputs = [self._end_beam_request(run, reason, error) for run in list(self._beams.values())]
        outputs += [self._finish(s, (), "", reason, error) for s in list(self._by_request.values()) if not s.internal]
        self._pending = None
        while self.scheduler.num_unresolved:
            self.scheduler.resolve({})        # every sequence is finished: nothing to fill in
        if self.scheduler.has_inflight:
            self.scheduler.on_step_done({})   # every sequence of the plan is finished: nothing commits
        return outputs

    @property
    def has_work(self) -> bool:
        return bool(self._by_request) or self._pending is not None

    def request_ids(self) -> list[str]:
        return [rid for rid, s in self._by_request.items() if not s.internal] + list(self._beams)

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward step. With overlap scheduling the outputs are those of the previous step,
        whose ids were copied to the host while this one was being scheduled and launched."""
        return self._route_beam_outputs(self._step())

    def _step(self) -> list[RequestOutput]:
        self._apply_disk_done()
        plan = self.scheduler.schedule()
        outputs = [self._finish(self._by_seq[sid], (), "", "error", msg) for sid, msg in plan.rejected]
        self._last_plan = plan
        self.runner.transfer_pages(plan.spills, plan.loads)
        if plan.disk_writes or plan.disk_reads or plan.disk_deletes:
            # after the transfers: a write reads a slot this step's spill fills (the event orders it)
            self.disk_io.submit(plan.disk_writes, plan.disk_reads, plan.disk_deletes, self.runner.transfer_done)
        if not plan.chunks:
            if self.disk_io is not None and self.disk_io.inflight and self._pending is None:
                # only requests waiting for disk reads: let the workers run instead of spinning
                self.disk_io.wait_done(0.005)
            return outputs + self._resolve_pending()
        overlap = self.config.overlap_enabled and self._overlap_eligible(plan)
        if not overlap:
            outputs += self._resolve_pending()   # this step needs every token on the host
        self.runner.copy_pages([(c.src, c.dst) for c in plan.copies])
        pending_rows = self._pending.rows if self._pending is not None else {}
        inputs = []
        sampling_ids = []
        # (sampling row, end ids) of the rows whose draw must not end them yet (overlap only: the
        # synchronous sampler applies min_tokens itself): fewer than min_tokens out, counting the
        # token the step still on the device is drawing
        end_bans = []
        now = time.monotonic()
        for chunk in plan.chunks:
            state = self._by_seq[chunk.seq_id]
            if state.first_scheduled_at is None:
                state.first_scheduled_at = now
            sampling = None
            if chunk.samples:
                sampling = SamplingRow(state.params, state.generator, state.prompt_ids, state.output_ids)
                p = state.params
                if overlap and p.min_tokens and len(state.output_ids) + (chunk.seq_id in pending_rows) < p.min_tokens:
                    end_bans.append((len(sampling_ids), p.end_ids))
                sampling_ids.append(chunk.seq_id)
            if chunk.start >= len(state.prompt_ids) + len(state.output_ids):
                ids = (future_ref(pending_rows[chunk.seq_id]),)   # sampled by the step still on the device
            else:
                ids = state.token_slice(chunk.start, chunk.num_tokens)
            prompt = chunk.start < len(state.prompt_ids)
            all_logits = state.params.return_context_logits and prompt
            inputs.append(ChunkInput(ids, chunk.start, self.scheduler.page_table(chunk.seq_id), sampling, all_logits,
                                     prompt=prompt))
        if self._faults is not None:
            self._faults.check("forward")
        if overlap:
            launched = self.runner.launch_greedy(inputs, end_bans)
            self.scheduler.advance()
            outputs += self._resolve_pending()
            self._pending = _PendingStep(tuple(sampling_ids), {s: i for i, s in enumerate(sampling_ids)}, launched)
            return outputs
        tokens, details, context = self.runner.execute(inputs)
        for chunk, rows in zip(plan.chunks, context):
            if rows is not None:
                self._collect_context_logits(self._by_seq[chunk.seq_id], chunk.start, rows)
        sampled = dict(zip(sampling_ids, tokens))
        self.scheduler.on_step_done(sampled)
        return outputs + self._emit(sampled, dict(zip(sampling_ids, details)))

    @property
    def last_step(self) -> StepShape:
        """What the last step ran (benchmarks' step profiles), derived from its plan on request."""
        plan = self._last_plan
        if plan is None or not plan.chunks:
            return StepShape(0, 0, "none")
        decode_rows = sum(1 for c in plan.chunks if c.num_tokens == 1)
        return StepShape(decode_rows, plan.num_tokens - decode_rows, self.runner.last_path)

    def _overlap_eligible(self, plan) -> bool:
        """Rows whose sampling needs the previous token on the host (penalties, bad words, biases,
        random draws) run synchronously; greedy rows only need the argmax, which stays on the
        device, and min_tokens only bans end ids there (end_bans in _step)."""
        for chunk in plan.chunks:
            p = self._by_seq[chunk.seq_id].params
            if chunk.samples and (not p.greedy or p.adjusts_logits_per_row or p.needs_logits_on_host):
                return False
            if p.return_context_logits and chunk.start < len(self._by_seq[chunk.seq_id].prompt_ids):
                return False     # its prompt rows' logits come back: the eager step (ModelRunner.execute)
        return True

    @staticmethod
    def _collect_context_logits(state: RequestState, start: int, rows) -> None:
        """Keep the logits of prompt positions not kept yet (a preempted request recomputes some)."""
        end = min(start + rows.shape[0], len(state.prompt_ids))
        if end > state.context_collected:
            state.context_logits.append(rows[state.context_collected - start:end - start])
            state.context_collected = end

    def _resolve_pending(self) -> list[RequestOutput]:
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        sampled = dict(zip(pending.seq_ids, pending.launched.tokens()))
        self.scheduler.resolve(sampled)
        return self._emit(sampled)

    def _emit(self, sampled: dict[int, int], details: dict | None = None) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for seq_id, token in sampled.items():
            state = self._by_seq.get(seq_id)
            if state is not None:          # else finished or cancelled while its step ran: the token is dropped
                outputs.append(self._on_token(state, token, now, details.get(seq_id) if details else None))
        return outputs

    def _on_token(self, state: RequestState, token: int, now: float, detail=None) -> RequestOutput:
        p = state.params
        if state.first_token_at is None:
            state.first_token_at = now
            state.cached_tokens = self.scheduler.num_cached_tokens(state.seq_id)
            if not state.internal:
                self._ttft.append(now - state.arrival)
        elif not state.internal:
            self._itl.append(now - state.last_token_at)
        state.last_token_at = now
        state.output_ids.append(token)
        self._generation_tokens_total += 1
        n_out = len(state.output_ids)
        past_min = n_out >= p.min_tokens
        text = ""
        ends = token in state.end_ids and not p.ignore_eos and past_min
        if state.detokenizer is not None and not ends:   # the end token is not part of the text (TRT-LLM's end_id)
            if self._faults is not None:
                self._faults.check("detokenize")
            text = state.detokenizer.add(token, check_stop=past_min)
        if len(state.output_ids) == 1 and state.echo_prompt:
            text = state.echo_prompt + text
        extras = _NO_EXTRAS if detail is None and not state.context_logits and not p.return_timing else {}
        if state.context_logits:
            extras["context_logits"] = torch.cat(state.context_logits)
            state.context_logits = []
        if detail is not None:
            if p.logprobs >= 0:
                extras["logprobs"] = (detail.logprob,)
            if p.logprobs > 0:
                extras["top_logprobs"] = (detail.top,)
            if detail.logits is not None:
                extras["generation_logits"] = (detail.logits,)
        reason = None
        if ends:
            reason = "stop"
        elif state.detokenizer is not None and state.detokenizer.stopped:
            reason = "stop"
        elif n_out >= p.max_tokens or len(state.prompt_ids) + n_out >= self.max_model_len:
            reason = "length"
        if reason is not None:
            return self._finish(state, (token,), text, reason, None, **extras)
        if p.return_timing:     # not on a final output: _finish reads it there
            extras["timing"] = self._timing(state)
        return RequestOutput(state.request_id, (token,), text, False, None, len(state.prompt_ids), n_out,
                             state.cached_tokens, **extras)

    def _finish(self, state: RequestState, new_ids: tuple[int, ...], text: str, reason: str,
                error: str | None, **extras) -> RequestOutput:
        timing = self._timing(state)
        self.scheduler.finish(state.seq_id)
        self._by_request.pop(state.request_id, None)
        self._by_seq.pop(state.seq_id, None)
        if reason in ("stop", "length") and state.detokenizer is not None:
            text += state.detokenizer.finish()
        return RequestOutput(state.request_id, new_ids, text, True, reason, len(state.prompt_ids),
                             len(state.output_ids), state.cached_tokens, error, timing=timing, **extras)

    def _timing(self, state: RequestState) -> RequestTiming:
        return self._timing_of(state.arrival, self._wall_ns(state.first_scheduled_at), state.first_token_at,
                               state.last_token_at, state.cached_tokens, len(state.prompt_ids), len(state.output_ids))

    def _wall_ns(self, t: float | None) -> int:
        return 0 if t is None else int(t * 1e9) + self._wall_offset_ns

    def _timing_of(self, arrival: float, first_scheduled_ns: int, first_token_at: float | None,
                   last_token_at: float | None, cached_tokens: int, prompt_len: int, n_out: int) -> RequestTiming:
        # The KV it holds at the end: every token but the last sampled one (never fed back).
        held = prompt_len + n_out - 1 if n_out else 0
        total = -(-held // self.kv.page_size)
        reused = min(cached_tokens // self.kv.page_size, total)
        return RequestTiming(self._wall_ns(arrival), first_scheduled_ns, self._wall_ns(first_token_at),
                             self._wall_ns(last_token_at), reused, total - reused, total)

    # -- observability ------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        self._apply_disk_done()      # an idle engine takes no step: finished writes still count now
        return EngineStats(self.scheduler.stats(), self.scheduler.num_running, self.scheduler.num_waiting,
                           self._prompt_tokens_total, self._generation_tokens_total,
                           self.kv.host_page_bytes if self.kv.host_pages else 0)

    def drain_latencies(self) -> tuple[list[float], list[float]]:
        """TTFT and inter-token latency samples (seconds) since the previous call."""
        ttft, itl, self._ttft, self._itl = self._ttft, self._itl, [], []
        return ttft, itl

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        assert set(self._by_seq) == {s.seq_id for s in self._by_request.values()}


def release_window(configured: int | None, model) -> int:
    """The sliding window whose out-of-window pages go back to the pool: the model's own window
    (every layer's, ModelConfig.kv_release_window) unless the config turns it off (0). A window the
    model does not have is refused: releasing those pages would drop keys its layers still read."""
    model_window = int(getattr(model, "kv_release_window", 0) or 0)
    if configured is None:
        return model_window
    if configured < 0:
        raise ValueError(f"kv_release_window must be >= 0 (0 = keep every page), got {configured}")
    if configured and configured != model_window:
        raise ValueError(
            f"kv_release_window={configured} but the model's layers do not all attend a window of {configured} "
            f"(its kv_release_window is {model_window}; 0 means some layer reads every key): releasing those "
            "pages would drop keys the model reads")
    return configured


def _tensor_parallel_config(config: EngineConfig) -> EngineConfig:
    """Tensor parallelism runs eagerly and synchronously for now: a captured graph or an overlapped
    step would run rank 0's collectives without the followers (docs/develop/engine.md)."""
    if config.overlap_schedule:
        raise ValueError("overlap_schedule is not supported with tensor_parallel_size > 1 yet")
    return dataclasses.replace(config, cuda_graphs=False, overlap_schedule=False)
