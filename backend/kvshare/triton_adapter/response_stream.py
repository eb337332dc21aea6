"""Sends RequestOutputs to Triton clients from a dedicated thread, one engine step at a time.

The engine thread hands over each step's outputs as one list and never waits for IPC: a response
costs ~30 µs of GIL-held Python to build plus an IPC round trip to the Triton process (~60-200 µs,
GIL released) to send. When the pump falls behind, all queued deltas of a request go out as one
response. With ``stream_interval`` N > 1 a stream's deltas are held until N tokens are pending (the
first delta and the final response are never held), so the pump sends ~N times fewer responses and
takes that much less of the GIL that the engine thread needs (docs/develop/engine.md).

A response that cannot be built or sent still ends its Triton request: the client gets an error
final (which also releases Triton's response factory: an unreleased one keeps the model alive at
shutdown), and the engine request is abandoned so that its pages return (docs/operate/troubleshoot.md).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..engine.faults import FaultInjector
from ..engine.outputs import RequestOutput, coalesce, merge_outputs
from .inputs import GenerationRequest

log = logging.getLogger("kvshare.triton")


@dataclass(eq=False)
class Reply:
    """A Triton request answered by several engine requests (a [B, ...] batch, num_return_sequences
    n > 1): the response sender they share, and how many of them are still open. Only the last one
    to finish sends the final flag, so the client sees one final response for the whole request."""
    open: int
    closed: bool = False        # an error final already went out: its members' later outputs are dropped


@dataclass(eq=False)
class ClientStream:
    """One engine request's response sender and what its client asked to receive."""
    sender: object
    request: GenerationRequest
    # Held back: a non-streaming request's outputs until the end, or a stream's delta until it has
    # stream_interval tokens.
    buffered: RequestOutput | None = None
    responses_sent: int = 0
    sequence_index: int = 0
    reply: Reply | None = None          # None: this engine request is the whole Triton request
    cum_logprob: float = 0.0            # over the tokens sent so far (cum_log_probs is cumulative)
    # The outputs its client asked for (requested_output_names(); empty: every one). A response
    # carries only these: see only_requested.
    requested: frozenset[str] = frozenset()

    def closes_reply(self) -> bool:
        """Called once, when this stream's final output goes out: is it the request's last?"""
        if self.reply is None:
            return True
        self.reply.open -= 1
        return self.reply.open == 0


def only_requested(tensors: list, requested: frozenset[str]) -> list:
    """The tensors a response may carry: those its request asked for (all when it names none).

    Triton 2.51's Python backend drops the others inside ResponseSender.send() with the GIL
    released, and dropping a tensor frees its numpy array: without the GIL that corrupts the stub's
    object allocator, which later crashes the stub (a soak reproduced it: a segfault in pymalloc on
    the stub's BLS-response thread). The fix upstream holds the GIL there (python_backend #390,
    after 24.10); until then nothing must be left for send() to drop."""
    if not requested:
        return tensors
    return [t for t in tensors if t.name() in requested]


def error_response(pb, message: str, code: str = "INVALID_ARG"):
    """A final error response; code names a pb.TritonError code (INVALID_ARG, INTERNAL, UNAVAILABLE)."""
    try:
        err = pb.TritonError(message, getattr(pb.TritonError, code))
    except (AttributeError, TypeError):   # stubs without error codes
        err = pb.TritonError(message)
    return pb.InferenceResponse(output_tensors=[], error=err)


class FinalTracking:
    """A request's response sender that remembers whether its final response went out."""

    def __init__(self, sender, final_flag: int):
        self._sender = sender
        self._final_flag = final_flag
        self.final_sent = False

    def send(self, response=None, flags: int = 0) -> None:
        if response is None:
            self._sender.send(flags=flags)
        else:
            self._sender.send(response, flags=flags)
        if flags & self._final_flag:
            self.final_sent = True

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled()


def serve_to_the_end(pb, name: str, request, serve: Callable[[object, FinalTracking], None], log) -> None:
    """Runs serve(request, sender) on a worker thread so that the request always ends: an exception
    is logged (a worker's future is never read, so it would vanish), and a request left without its
    final response (serve failed before or while sending it) gets an INTERNAL one. Triton does not
    end a decoupled request whose sender is dropped: its client would wait forever."""
    final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    sender = FinalTracking(request.sender, final)      # request: a request_snapshot.RequestSnapshot
    request_id = request.request_id
    log.debug("%s: request %s arrived", name, request_id)
    try:
        serve(request, sender)
    except BaseException:
        log.exception("%s: serving a request failed", name)
    finally:
        log.debug("%s: request %s served (final sent: %s)", name, request_id, sender.final_sent)
        if not sender.final_sent:
            try:
                sender.send(error_response(pb, f"{name}: the request ended without its final response "
                                               "(internal error, see the server log)", "INTERNAL"), flags=final)
            except Exception:
                log.exception("%s: the backstop final response could not be sent; closing the request without one",
                              name)
                close_without_response(sender, final, request_id, log)


def close_without_response(sender, final_flag: int, request_id: str, log) -> None:
    """A final that did not go out would keep its response factory, and Triton finalizes the model
    (an unload, a shutdown) only once every factory is released: a final without a response."""
    try:
        sender.send(flags=final_flag)
    except Exception:
        log.warning("could not close request %s either", request_id, exc_info=True)


def overloaded_response(pb, in_flight: int, limit: int):
    return error_response(pb, f"llm_engine is overloaded: {in_flight} requests are already running or queued "
                              f"(max_queued_requests = {limit}); retry later", "UNAVAILABLE")


class ResponseBuilder:
    """Builds response tensors, reusing those whose value repeats.

    send() returns only after the Triton process has copied a response's tensors into its own
    buffers, so one pb_utils.Tensor can go out in any number of responses. Most tensors of a
    streamed response repeat: the empty finish_reason of every non-final response, an empty text
    delta (a token that completes no character; always with dummy weights), a request's
    cached_tokens and num_input_tokens. Reusing them skips a numpy allocation, and for BYTES tensors
    the stub's pure-Python serializer, leaving output_ids and a non-empty text to build each time.
    """

    _MAX_CACHED_INTS = 4096     # distinct (name, value) ints kept; values are token counts, so few repeat far

    def __init__(self, pb):
        self._pb = pb
        self._strings: dict[tuple[str, str], object] = {}
        self._ints: dict[tuple[str, int], object] = {}
        self._empty = None

    def _string(self, name: str, value: str):
        key = (name, value)
        tensor = self._strings.get(key)
        if tensor is None:
            tensor = self._pb.Tensor(name, np.array([[value.encode("utf-8")]], dtype=np.object_))
            self._strings[key] = tensor
        return tensor

    def _empty_text(self):
        """text_output "" (rank 1, as every text_output: TRT-LLM's clients read output[0].decode())."""
        if self._empty is None:
            self._empty = self._pb.Tensor("text_output", np.array([b""], dtype=np.object_))
        return self._empty

    def _int(self, name: str, value: int):
        key = (name, value)
        tensor = self._ints.get(key)
        if tensor is None:
            if len(self._ints) >= self._MAX_CACHED_INTS:
                self._ints.clear()
            tensor = self._pb.Tensor(name, np.array([[value]], dtype=np.int32))
            self._ints[key] = tensor
        return tensor

    def response(self, out: RequestOutput, req: GenerationRequest, sequence_index: int = 0,
                 cum_logprob: float = 0.0, requested: frozenset[str] = frozenset()):
        """The response tensors of one output, shaped as TensorRT-LLM's: text_output rank 1 (one
        string per beam), the per-response scalars [1, 1]; batch_index only for a batched request,
        sequence_index only for num_return_sequences > 1 (as TRT-LLM sends them)."""
        pb = self._pb
        if out.beams:
            return pb.InferenceResponse(output_tensors=only_requested(self._beam_tensors(out, req), requested))
        text = (self._empty_text() if not out.text
                else pb.Tensor("text_output", np.array([out.text.encode("utf-8")], dtype=np.object_)))
        tensors = [
            text,
            pb.Tensor("output_ids", np.array(out.token_ids, dtype=np.int32).reshape(1, -1)),
            # Only five values (None and the four reasons): always cached.
            self._string("finish_reason", out.finish_reason or ""),
            self._int("cached_tokens", out.cached_tokens),
        ]
        self._common(tensors, out, req, sequence_index)
        if req.return_log_probs:
            tensors.append(pb.Tensor("cum_log_probs", np.array([[cum_logprob]], dtype=np.float32)))
            tensors.append(pb.Tensor("output_log_probs", np.array(out.logprobs, dtype=np.float32).reshape(1, 1, -1)))
        if req.return_context_logits and out.context_logits is not None:
            tensors.append(pb.Tensor("context_logits", out.context_logits.numpy().astype(np.float32)[None]))
        if req.return_generation_logits:
            tensors.append(pb.Tensor("generation_logits", _stack(out.generation_logits).reshape(1, 1, len(out.generation_logits), -1)))
        return pb.InferenceResponse(output_tensors=only_requested(tensors, requested))

    def _common(self, tensors: list, out: RequestOutput, req: GenerationRequest, sequence_index: int) -> None:
        if req.return_num_input_tokens:
            tensors.append(self._int("num_input_tokens", out.num_prompt_tokens))
        if req.return_num_output_tokens:
            tensors.append(self._int("num_output_tokens", len(out.token_ids)))
        if req.batch_size > 1:
            tensors.append(self._int("batch_index", req.batch_index))
        if req.num_return_sequences > 1 and req.params.beam_width == 1:
            tensors.append(self._int("sequence_index", sequence_index))
        if req.return_perf_metrics and out.timing is not None:
            t = out.timing
            tensors += [self._int("kv_cache_alloc_new_blocks", t.kv_new_pages),
                        self._int("kv_cache_reused_blocks", t.kv_reused_pages),
                        self._int("kv_cache_alloc_total_blocks", t.kv_total_pages)]
            tensors += [self._pb.Tensor(name, np.array([[v]], dtype=np.int64)) for name, v in (
                ("arrival_time_ns", t.arrival_ns), ("first_scheduled_time_ns", t.first_scheduled_ns),
                ("first_token_time_ns", t.first_token_ns), ("last_token_time_ns", t.last_token_ns))]
            # no speculative decoding: nothing drafted, nothing accepted
            tensors += [self._pb.Tensor("acceptance_rate", np.zeros((1, 1), dtype=np.float32)),
                        self._int("total_accepted_draft_tokens", 0), self._int("total_draft_tokens", 0)]

    def _beam_tensors(self, out: RequestOutput, req: GenerationRequest) -> list:
        """A beam search's one response: every beam (best first, up to num_return_sequences when
        set), output_ids [1, W, max_len] padded with pad_id (-1 when unset), as TensorRT-LLM."""
        pb = self._pb
        beams = out.beams[:req.num_return_sequences] if req.num_return_sequences > 1 else out.beams
        echo = out.text[:len(out.text) - len(beams[0].text)] if beams and out.text.endswith(beams[0].text) else ""
        width = max(len(b.token_ids) for b in beams) if beams else 0
        pad = -1 if req.pad_id is None else req.pad_id
        ids = np.full((1, len(beams), width), pad, dtype=np.int32)
        logprobs = np.zeros((1, len(beams), width), dtype=np.float32)
        for j, b in enumerate(beams):
            ids[0, j, :len(b.token_ids)] = b.token_ids
            logprobs[0, j, :len(b.logprobs)] = b.logprobs
        tensors = [pb.Tensor("text_output", np.array([(echo + b.text).encode("utf-8") for b in beams], dtype=np.object_)),
                   pb.Tensor("output_ids", ids), self._string("finish_reason", out.finish_reason or ""),
                   self._int("cached_tokens", out.cached_tokens)]
        self._common(tensors, out, req, 0)
        if req.return_log_probs:
            tensors.append(pb.Tensor("cum_log_probs", np.array([[b.cum_logprob for b in beams]], dtype=np.float32)))
            tensors.append(pb.Tensor("output_log_probs", logprobs))
        return tensors


def _stack(logits: tuple) -> np.ndarray:
    """Host fp32 logits rows (torch tensors) as one numpy array [n, V]."""
    if not logits:
        return np.zeros((0, 0), dtype=np.float32)
    return np.stack([row.numpy() for row in logits]).astype(np.float32, copy=False)


def build_response(pb, out: RequestOutput, req: GenerationRequest, sequence_index: int = 0):
    """One response without tensor reuse (what ResponseBuilder.response must equal)."""
    return ResponseBuilder(pb).response(out, req, sequence_index)


class ResponsePump:
    def __init__(self, pb, stream_interval: int = 1, *, on_abandoned: Callable[[str], None] | None = None,
                 faults: FaultInjector | None = None):
        """on_abandoned(request_id): called when a request's client can no longer be answered (its
        response failed), before the pump sends that client its error final: the engine must stop
        probing the request at once and end it (EngineLoop.abandon); faults: tests only."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self._pb = pb
        self._on_abandoned = on_abandoned
        self._faults = faults
        self._interval = stream_interval
        self._builder = ResponseBuilder(pb)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, ClientStream] = {}
        self._lock = threading.Lock()
        self.responses_sent = 0
        self.tokens_sent = 0
        self._thread = threading.Thread(target=self._run, name="kvshare-responses", daemon=True)
        self._thread.start()

    def register(self, request_id: str, stream: ClientStream) -> None:
        with self._lock:
            self._streams[request_id] = stream

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def put(self, out: RequestOutput) -> None:
        """One output, from any thread."""
        self._queue.put([out])

    def put_many(self, outputs: list[RequestOutput]) -> None:
        """A whole engine step's outputs (the engine thread's batch sink): one wake-up of the pump per
        step rather than one per output, and the pump finds the step complete when it runs."""
        if outputs:
            self._queue.put(outputs)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            batches = [self._queue.get()]
            while True:
                try:
                    batches.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            outputs = [out for batch in batches if batch is not None for out in batch]
            if outputs:
                try:
                    outputs = coalesce(outputs)
                except ValueError:      # an output after its request's final: a bug upstream; send as they are
                    log.exception("outputs did not coalesce")
                self._send_batch(outputs)
            if None in batches:
                return

    def _send_batch(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            streams = [self._streams.get(out.request_id) for out in outputs]
            for out in outputs:
                if out.finished:
                    self._streams.pop(out.request_id, None)
        for out, stream in zip(outputs, streams):
            if stream is None or (stream.reply is not None and stream.reply.closed):
                continue
            try:
                due = self._due(stream, out)
            except Exception as exc:
                self._fail(out.request_id, stream, out.finished, f"internal error while streaming: {exc}")
                continue
            if due is not None:
                self._send(stream, due)

    def _due(self, stream: ClientStream, out: RequestOutput) -> RequestOutput | None:
        """What to send for this stream now (its held-back deltas merged in), or None to keep holding."""
        if stream.buffered is not None:
            out = merge_outputs(stream.buffered, out)
            stream.buffered = None
        if out.finished:
            return out
        # The first delta goes at once so that stream_interval never delays the first token.
        if not stream.request.stream or (stream.responses_sent and len(out.token_ids) < self._interval):
            stream.buffered = out
            return None
        return out

    def _send(self, stream: ClientStream, out: RequestOutput) -> None:
        try:
            if out.finish_reason == "error":
                response = error_response(self._pb, out.error or "generation failed", "INTERNAL")
            else:
                if self._faults is not None:      # not on an error final: that one must reach the client
                    self._faults.check("pump")
                response = self._builder.response(out, stream.request, stream.sequence_index,
                                                  stream.cum_logprob + sum(out.logprobs), stream.requested)
        except Exception as exc:
            log.exception("building a response of request %s failed", out.request_id)
            self._fail(out.request_id, stream, out.finished, f"internal error while building a response: {exc}")
            return
        final = out.finished and stream.closes_reply()
        try:
            stream.sender.send(response, flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            if final:
                log.debug("request %s: final response sent (%s)", out.request_id, out.finish_reason)
        except Exception:
            if not final:
                # The client went away (or the stub refused): end the request on both sides.
                log.debug("could not send to request %s", out.request_id, exc_info=True)
                self._fail(out.request_id, stream, out.finished, "the response could not be sent")
                return
            log.info("could not send the final response of request %s; closing it without one",
                     out.request_id, exc_info=True)
            self._close_bare(stream, out.request_id)
            return
        stream.cum_logprob += sum(out.logprobs)
        stream.responses_sent += 1
        self.responses_sent += 1
        self.tokens_sent += len(out.token_ids)

    def _fail(self, request_id: str, stream: ClientStream, finished: bool, message: str) -> None:
        """Ends a Triton request whose response failed: one error final for the whole request (every
        engine request of a batched or n > 1 reply), the engine asked to end those still running.
        The abandon comes first: it stops the request's cancellation probe, which must never run
        once a final has gone out (in the stub the final frees what is_cancelled() reads)."""
        with self._lock:
            members = [request_id] if stream.reply is None else \
                [rid for rid, s in self._streams.items() if s.reply is stream.reply] + [request_id]
            for rid in members:
                self._streams.pop(rid, None)
        if stream.reply is not None:
            stream.reply.closed = True
        if self._on_abandoned is not None:
            for rid in dict.fromkeys(members):
                if rid != request_id or not finished:
                    try:
                        self._on_abandoned(rid)
                    except Exception:
                        log.exception("abandoning request %s failed", rid)
        try:
            stream.sender.send(error_response(self._pb, message, "INTERNAL"),
                               flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            log.info("could not send the error final of request %s; closing it without one", request_id,
                     exc_info=True)
            self._close_bare(stream, request_id)

    def _close_bare(self, stream: ClientStream, request_id: str) -> None:
        close_without_response(stream.sender, self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL, request_id, log)
