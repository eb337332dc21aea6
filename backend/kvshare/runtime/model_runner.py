"""Runs one engine step on the model: page copies, the forward over the paged cache, sampling.

Decode-only steps replay a CUDA graph when one is captured (CudaGraphRunner), steps with a prefill
chunk one of the mixed-step graphs up to their largest token count (MixedGraphRunner); longer
steps, steps that return every prompt token's logits, and every step on the CPU run the forward
eagerly from a ForwardBatch built on the host.
A decode step whose rows share enough prefix pages (cascade_planner) runs with cascade attention
(the shared pages are read once per group): in the batch's cascade graph when there is one, else
eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from .cascade_planner import CascadePolicy, plan_shared_prefixes
from .cuda_graph_runner import CudaGraphRunner, resolve_future_ids
from .end_id_ban import EndIdBan
from .forward_batch import build_forward_batch, to_device
from .kv_cache import KVCache
from .llama import LlamaModel
from .mixed_graph_runner import MixedGraphRunner
from .page_transfer import PageTransfer
from .sampler import Sampler, SamplingRow, TokenDetail
from .step_threads import StepThreads


@dataclass(frozen=True)
class LaunchedStep:
    """A step's greedy ids on their way to the host (overlap scheduling): tokens() waits for them."""
    num_rows: int
    host_ids: torch.Tensor                # a pinned int64 slot the device copies the ids into
    event: torch.cuda.Event | None        # recorded after that copy (None on the CPU: already done)

    def tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host_ids[:self.num_rows].tolist()


def future_ref(row: int) -> int:
    """The token id to pass for "the id the previous launched step sampled in row ``row``"."""
    return -1 - row


@dataclass(frozen=True)
class ChunkInput:
    token_ids: Sequence[int]           # tokens whose KV this step computes; future_ref(r) < 0 for a
                                       # decode input still on the device (the previous launch's row r)
    start: int                         # position of token_ids[0]
    page_table: Sequence[int]          # the sequence's physical pages, in order
    sampling: SamplingRow | None       # set when a next token is wanted after this chunk
    all_logits: bool = False           # return every token's logits (return_context_logits; eager steps only)
    prompt: bool = False               # token_ids are prompt tokens (a prefill chunk, however short)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, sampler: Sampler, device: torch.device, *,
                 max_model_len: int | None = None, graph_batch_sizes: Sequence[int] = (),
                 mixed_graph_tokens: Sequence[int] = (), cascade: CascadePolicy | None = None, max_rows: int = 256, overlap: bool = False,
                 mirror: Callable[[str, object], None] | None = None, step_threads: StepThreads | None = None):
        self.model, self.kv, self.sampler, self.device = model, kv, sampler, device
        # CPU: torch threads per step kind (step_threads.py); None leaves torch's count alone.
        self.step_threads = step_threads if device.type == "cpu" else None
        # Tensor parallelism, rank 0: every page move and forward batch goes to the other ranks first
        # (runtime/tensor_parallel.StepMirror), so they run the same collectives in the same order.
        # CUDA graphs would replay without telling them: not with a mirror (yet).
        if mirror is not None and (graph_batch_sizes or mixed_graph_tokens or overlap):
            raise ValueError("tensor parallelism runs without CUDA graphs and overlap scheduling (for now)")
        self.mirror = mirror
        # Overlap scheduling: the last launched step's ids stay here on the device, where the next
        # step's future_ref inputs are gathered from (inside the decode graph too); host copies
        # go to two pinned slots in turn (a step's slot is read before it is reused two steps on).
        self.last_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._host_slots = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if pin else [None, None]
        self._slot = 0
        self._end_ban = EndIdBan(sampler.eos, max_rows, device)    # min_tokens, the model's end ids
        self.transfer = PageTransfer(kv, device)   # host tier moves on their own stream (CUDA)
        self.last_path = "none"       # graph | cascade-graph | mixed-graph | cascade | eager (step profiles)
        self.cascade = cascade        # None: every decode reads each row's pages itself
        self._kv_bytes_per_token = kv.bytes_per_token     # 8-bit pages: about half (scales included)
        # Decode steps size the kernel's split-K from this bound (graphs must fix it at capture); eager
        # decodes on CUDA use it too, so graphs on and off run the same kernels.
        self.decode_context = max_model_len or model.config.max_position
        self.graphs: CudaGraphRunner | None = None
        if device.type == "cuda" and graph_batch_sizes:
            self.graphs = CudaGraphRunner(
                model, kv, graph_batch_sizes, self.decode_context, device, future_ids=self.last_ids if overlap else None,
                cascade_min_batch=cascade.min_batch if cascade is not None else None,
                cascade_members=cascade.max_members if cascade is not None else 16)
            self.graphs.capture()
        # CUDA: every step with a prefill chunk hands the prefill kernel a work list (forward_batch.py)
        self._prefill_tile_tokens = None
        if device.type == "cuda":
            from kvshare_kernels.prefill_attention import default_launch
            from kvshare_kernels.prefill_tiles import tokens_per_tile

            # the kernel's own launch for this pool (larger tiles where a page holds them, or where
            # the chunk's keys come from the step), so the work lists match the programs it runs
            launch = default_launch(kv.page_size, kv.dtype, model.config.head_dim, device,
                                    new_kv=model.prefill_reads_new_kv(kv.dtype))
            self._prefill_tile_tokens = tokens_per_tile(model.config.num_heads, model.config.num_kv_heads,
                                                        launch.block_m)
        self.mixed_graphs: MixedGraphRunner | None = None
        if device.type == "cuda" and mixed_graph_tokens:
            self.mixed_graphs = MixedGraphRunner(model, kv, mixed_graph_tokens, max_rows, self.decode_context,
                                                 self._prefill_tile_tokens, device,
                                                 future_ids=self.last_ids if overlap else None)
            self.mixed_graphs.capture()
        if device.type == "cuda" and mirror is None and kv.num_pages >= 2:
            # Triton compiles a kernel at its first launch. Copy-on-write's first page copy, mid-way
            # through a serving run, held every stream ~0.4 s on the H200 (docs/develop/engine.md), so
            # it is compiled here. Both pages are free and zero at start-up: zeros over zeros.
            self.copy_pages([(0, 1)])

    def transfer_pages(self, spills: Sequence[tuple[int, int]], loads: Sequence[tuple[int, int]]) -> None:
        """The host tier's moves, before the step's copies and forward: spills (GPU page -> host slot)
        first, then loads (host slot -> GPU page). On CUDA they run on PageTransfer's stream; the
        step's forward waits only for the gather of spilled pages and for the loads."""
        if self.mirror is not None and (spills or loads):
            self.mirror("transfer", (tuple(spills), tuple(loads)))
        self.transfer.run(spills, loads)

    @property
    def transfer_done(self) -> torch.cuda.Event | None:
        """Recorded after the last transfer (None on the CPU): disk jobs on host slots wait on it."""
        return self.transfer.done

    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies:
            return
        if self.mirror is not None:
            self.mirror("copy", tuple(copies))
        src, dst = to_device(_columns(copies), self.device)   # one upload for both lists
        self.model.ops.copy_page_tensors(self.kv.page_tensors(), src, dst)

    def execute(self, chunks: Sequence[ChunkInput]) -> tuple[list[int], list[TokenDetail | None], list]:
        """One sampled token per chunk that has ``sampling``, in chunk order; what each row asked
        for beside it (log-probabilities, raw logits; None for rows that asked nothing); and per
        chunk its tokens' fp32 logits on the host [n, V] when it asked for all of them, else None."""
        rows = [c.sampling for c in chunks if c.sampling is not None]
        all_logits = any(c.all_logits for c in chunks)
        logits, greedy = self._forward(chunks, len(rows), all_logits)
        context: list = [None] * len(chunks)
        if all_logits:
            logits, context = self._split_context_logits(chunks, logits)
        if not rows:
            return [], [], context
        tokens = self.sampler(logits, rows, greedy_ids=greedy)
        return tokens, self.sampler.details(logits, rows, tokens), context

    @staticmethod
    def _split_context_logits(chunks: Sequence[ChunkInput], logits: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The forward's rows (build_forward_batch's all_logits order) as the sampling rows' logits and
        each all-logits chunk's rows on the host."""
        context, sampling_rows, at = [None] * len(chunks), [], 0
        for i, c in enumerate(chunks):
            if c.all_logits:
                n = len(c.token_ids)
                context[i] = logits[at:at + n].float().cpu()
                at += n
                if c.sampling is not None:
                    sampling_rows.append(at - 1)
            elif c.sampling is not None:
                sampling_rows.append(at)
                at += 1
        index = torch.tensor(sampling_rows, dtype=torch.long, device=logits.device)
        return logits.index_select(0, index), context

    def launch_greedy(self, chunks: Sequence[ChunkInput],
                      end_bans: Sequence[tuple[int, tuple[int, ...] | None]] = ()) -> LaunchedStep:
        """Overlap scheduling: run the step and take the argmax of every sampling row without waiting.

        The ids stay on the device for the next step's future_ref inputs and travel to a pinned
        host slot behind the step; LaunchedStep.tokens() waits for them. For steps whose rows are
        all greedy with no penalties (the engine decides). end_bans: (sampling row, its end ids or
        None for the model's EOS) of the rows still under their min_tokens, whose end ids must not
        be drawn (the sampler's rule, applied here on the device without a sync).
        """
        n = sum(1 for c in chunks if c.sampling is not None)
        logits, greedy = self._forward(chunks, n)
        if end_bans and self._end_ban.covers(end_bans):
            ids = self._end_ban.argmax(logits[:n], [row for row, _ in end_bans])
        elif end_bans:
            ids = self._argmax_without_ends(logits[:n], end_bans)
        else:
            ids = greedy if greedy is not None else logits.argmax(dim=-1)
        self.last_ids[:n].copy_(ids, non_blocking=True)
        slot, event = self._host_slots[self._slot], self._events[self._slot]
        self._slot ^= 1
        slot[:n].copy_(ids, non_blocking=True)
        if event is not None:
            event.record()
        return LaunchedStep(n, slot, event)

    def _argmax_without_ends(self, logits: torch.Tensor,
                             end_bans: Sequence[tuple[int, tuple[int, ...] | None]]) -> torch.Tensor:
        """Greedy ids with the banned rows' end ids at -inf: one small upload of (row, id) pairs
        through pinned memory and one index_put, so min_tokens keeps the overlap path and its
        graphs (a per-row host loop with a sync made every such step several times slower)."""
        rows, cols = [], []
        for row, ends in end_bans:
            ids = self.sampler.eos if ends is None else ends
            rows += [row] * len(ids)
            cols += ids
        with torch.inference_mode():     # the forward's logits are inference tensors
            if rows:
                idx = to_device(torch.tensor([rows, cols], dtype=torch.long), logits.device)
                logits[idx[0], idx[1]] = float("-inf")    # the logits are this step's own buffer
            return logits.argmax(dim=-1)

    def _forward(self, chunks: Sequence[ChunkInput], num_sampling: int,
                 all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 logits of the sampling rows, and their argmax when a decode graph computed it; with
        all_logits (some chunk returns every token's logits) the rows of build_forward_batch's order."""
        plan = None
        fits = not all_logits and self._graph_fits(chunks, num_sampling)
        if self.cascade is not None and all(len(c.token_ids) == 1 for c in chunks):
            in_graph = fits and self.graphs.has_cascade_graph(len(chunks))
            plan = plan_shared_prefixes([(c.page_table, c.start + 1) for c in chunks], self.kv.page_size,
                                        self.cascade, self._kv_bytes_per_token, graph=in_graph)
            if plan is not None and in_graph:
                self.last_path = "cascade-graph"
                return self.graphs.run([(c.token_ids[0], c.start, c.page_table) for c in chunks], plan=plan)
        if plan is None and fits:
            self.last_path = "graph"
            return self.graphs.run([(c.token_ids[0], c.start, c.page_table) for c in chunks])
        rows = [(c.token_ids, c.start, c.page_table, c.sampling is not None) for c in chunks]
        if plan is None and not all_logits and self.mixed_graphs is not None and any(len(c.token_ids) > 1 for c in chunks):
            tokens = self.mixed_graphs.size_for(rows)
            if tokens is not None:
                self.last_path = "mixed-graph"
                return self.mixed_graphs.run(rows, tokens, num_sampling), None
        self.last_path = "eager" if plan is None else "cascade"
        if plan is not None:
            plan = plan.to(self.device) if self.device.type != "cuda" else plan.pin_memory().to(self.device, non_blocking=True)
        decode_bound = self.decode_context if self.device.type == "cuda" else None
        # On the CPU a prompt's rows always take the prefill attention, whose rows do not depend on
        # the chunk's length: a prompt's tail after a prefix-cache hit then gets its first run's bits.
        # CUDA keeps its decode kernel (and graphs) for steps of single tokens.
        prompt_prefill = self.device.type == "cpu" and any(c.prompt for c in chunks)
        if self.step_threads is not None:
            self.step_threads.apply(prompt_prefill)
        batch = build_forward_batch(
            rows, self.kv.page_size, self.device, decode_max_context=decode_bound, cascade=plan,
            all_logits=[c.all_logits for c in chunks] if all_logits else None, prompt_prefill=prompt_prefill,
            prefill_tile_tokens=self._prefill_tile_tokens)
        if any(len(c.token_ids) == 1 and c.token_ids[0] < 0 for c in chunks):
            batch = replace(batch, input_ids=resolve_future_ids(batch.input_ids, self.last_ids))
        if self.mirror is not None:
            self.mirror("forward", batch)
        return self.model.forward(batch, self.kv), None

    def _graph_fits(self, chunks: Sequence[ChunkInput], num_sampling: int) -> bool:
        g = self.graphs
        if g is None or num_sampling != len(chunks) or g.batch_for(len(chunks)) is None:
            return False
        fits = g.buffers.fits
        return all(fits(c.token_ids, c.page_table) for c in chunks)


def _columns(pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """(a, b) pairs as an int32 host tensor [2, N]: rows are the contiguous page lists copy_pages takes."""
    return torch.tensor(pairs, dtype=torch.int32).t().contiguous()
