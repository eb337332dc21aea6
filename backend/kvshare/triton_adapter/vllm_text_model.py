"""Triton adapter of `vllm_model`: Triton's vLLM backend contract, served by `llm_engine` through BLS.

A request (text_input, stream, sampling_parameters JSON or the request's parameters,
exclude_input_in_output, return_*) becomes one llm_engine request (TensorRT-LLM-style tensors) under
a fresh request key, as `llm_bls` does; llm_engine's responses come back as vLLM's:

    client ──text, vLLM JSON──▶ vllm_model ──input_ids, sampling tensors, request_key──▶ llm_engine
           ◀──text_output [n]──            ◀──one sequence's delta (sequence_index when n > 1)──

- n > 1: llm_engine forks the n sequences (num_return_sequences). vLLM's responses carry one element
  per sequence, so a streamed delta of sequence i is text_output [n] holding "" for the others (their
  finish_reason and cumulative_logprob as last known, num_output_tokens 0, logprobs "[]"); a
  non-streamed request gets one response with all n texts.
- The final flag rides on the last data response (vLLM's shape, and what /generate needs).
- Cancellation: a watcher thread polls each client's is_cancelled() (streamed or not); when one
  fires, llm_engine gets a `cancel_request_key` control request and the client a CANCELLED error
  ("Request was cancelled", as vllm_backend). No probe runs once the request's final is sent (in the
  stub the final frees what is_cancelled() reads).
- Every request ends with exactly one final response: data, an INVALID_ARG naming the field, the
  engine's error, or CANCELLED.

What differs from vLLM (docs/integrate/contract.md): `logprobs` entries hold the sampled token only, with
"rank": null (llm_engine returns the sampled token's log-probability, not the top k);
`stop_token_ids` must fit llm_engine's one `end_id` (see `_end_id`); `logit_bias` token ids are sent
as llm_engine's `embedding_bias_words` and must round-trip through text.
"""
from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import triton_python_backend_utils as pb_utils

from ..engine.outputs import InvalidRequest
from .bls_stream import EngineCall, EngineLink, EngineStream
from .inputs import Getter, decode_utf8
from .logs import configure_logging
from .request_snapshot import RequestSnapshot, snapshot_request
from .response_stream import error_response, serve_to_the_end
from .text_prompt import TextPrompter
from .vllm_params import ParsedSampling, parse_request_parameters, parse_sampling_parameters

log = logging.getLogger("kvshare.triton")

RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                "return_num_output_tokens")
STREAM_ECHO_ERROR = "When streaming, `exclude_input_in_output` = False is not allowed."
# vLLM's str(finish_reason): None while running; kvshare's "cancelled" is vLLM's abort.
_FINISH = {"": "None", "cancelled": "abort"}
# llm_engine's field names in its errors -> the vLLM key the client sent.
_ENGINE_FIELDS = {"max_tokens": "max_tokens", "min_tokens": "min_tokens", "temperature": "temperature",
                  "top_p": "top_p", "top_k": "top_k", "seed": "seed", "bad_words": "bad_words",
                  "embedding_bias": "logit_bias", "end_id": "stop_token_ids", "logprobs": "logprobs",
                  "num_return_sequences": "n", "repetition_penalty": "repetition_penalty",
                  "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


# -- request -> llm_engine ------------------------------------------------------------------------------
@dataclass(frozen=True)
class VLLMRequest:
    prompt: str
    prompt_ids: tuple[int, ...]
    stream: bool
    prepend_input: bool                 # echo the prompt before each sequence's text (not streaming only)
    n: int
    logprobs: int | None                # vLLM's sampling logprobs (None: "null" in the logprobs output)
    returns: frozenset[str]             # the return_* flags that are on
    engine_inputs: tuple[tuple[str, np.ndarray], ...]   # llm_engine tensors besides input_ids and request_key
    field_prefix: str = "sampling_parameters."

    @property
    def want_log_probs(self) -> bool:
        return "return_cumulative_logprob" in self.returns or (
            "return_logprobs" in self.returns and self.logprobs is not None)

    def engine_outputs(self) -> list[str]:
        names = ["text_output", "output_ids", "finish_reason"]
        if self.n > 1:
            names.append("sequence_index")
        if self.want_log_probs:
            names += ["cum_log_probs", "output_log_probs"]
        return names


def _flag(get: Getter, name: str) -> bool | None:
    arr = get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.size != 1:
        raise InvalidRequest(name, f"expected one value (shape [1]), got shape {list(arr.shape)}")
    v = arr.reshape(-1)[0]
    if isinstance(v, (bytes, str, np.bytes_, np.str_)):
        raise InvalidRequest(name, "must be BOOL, got a string")
    return bool(v)


def read_request(get: Getter, parameters: str | None, *, tokenize: Callable[[Getter], list[int]], tokenizer,
                 eos_ids: frozenset[int], default_max_tokens: int = 1) -> VLLMRequest:
    """A vllm_model request (get: input name -> array | None; parameters: the request's parameters JSON).

    Validates everything first (errors name the field), tokenizes last. max_tokens is sent to
    llm_engine only when given (else the server's default_max_tokens applies).
    """
    for name, why in (("image", "kvshare does not support multimodal inputs"),
                      ("embedding_request", "kvshare does not serve embeddings")):
        if get(name) is not None:
            raise InvalidRequest(name, why)
    text = get("text_input")
    if text is None:
        raise InvalidRequest("text_input", "is required")
    text = np.asarray(text)
    if text.size != 1:
        raise InvalidRequest("text_input", f"expected one prompt (shape [1]), got shape {list(text.shape)}")
    prompt = decode_utf8(text.reshape(-1)[0], "text_input")

    tensor = get("sampling_parameters")
    if tensor is not None:
        tensor = np.asarray(tensor)
        if tensor.size != 1:
            raise InvalidRequest("sampling_parameters", f"expected one JSON string (shape [1]), got shape "
                                                        f"{list(tensor.shape)}")
        source = tensor.reshape(-1)[0]
        if not isinstance(source, (bytes, str, np.bytes_, np.str_)):
            raise InvalidRequest("sampling_parameters", "must be STRING (a JSON object)")
        parsed = parse_sampling_parameters(source, default_max_tokens=default_max_tokens)
        prefix = "sampling_parameters."
    else:
        source = parameters or "{}"
        parsed = parse_request_parameters(source, default_max_tokens=default_max_tokens)
        prefix = "parameters."
    given = _given_keys(source)
    from_params = dict(parsed.extras.inputs)

    def flag(name: str) -> bool | None:
        v = _flag(get, name)
        return from_params.get(name) if v is None else v

    stream = bool(flag("stream"))
    exclude = flag("exclude_input_in_output")
    prepend = (not stream) if exclude is None else not exclude
    if prepend and stream:
        raise InvalidRequest("exclude_input_in_output", STREAM_ECHO_ERROR)
    returns = frozenset(name for name in RETURN_FLAGS if flag(name))
    want_log_probs = "return_cumulative_logprob" in returns or (
        "return_logprobs" in returns and parsed.extras.logprobs is not None)
    engine = engine_inputs(parsed, max_tokens_given="max_tokens" in given, stream=stream,
                           want_log_probs=want_log_probs, tokenizer=tokenizer, eos_ids=eos_ids, prefix=prefix)
    ids = tokenize(lambda name: text.reshape(1, 1) if name == "text_input" else None)
    return VLLMRequest(prompt=prompt, prompt_ids=tuple(ids), stream=stream, prepend_input=prepend, n=parsed.n,
                       logprobs=parsed.extras.logprobs, returns=returns, engine_inputs=tuple(engine.items()),
                       field_prefix=prefix)


def _given_keys(source) -> set[str]:
    """Keys of the (already validated) JSON whose value is not null."""
    if isinstance(source, dict):
        d = source
    else:
        raw = source.decode("utf-8") if isinstance(source, (bytes, bytearray, np.bytes_)) else str(source)
        d = json.loads(raw) if raw.strip() else {}
    return {k for k, v in d.items() if v is not None}


def _i32(v: int) -> np.ndarray:
    return np.array([[v]], dtype=np.int32)


def _f32(v: float) -> np.ndarray:
    return np.array([[v]], dtype=np.float32)


def _bool(v: bool) -> np.ndarray:
    return np.array([[v]], dtype=bool)


def _strings(words) -> np.ndarray:
    return np.array([[w.encode("utf-8") for w in words]], dtype=np.object_)


def engine_inputs(parsed: ParsedSampling, *, max_tokens_given: bool, stream: bool, want_log_probs: bool,
                  tokenizer, eos_ids: frozenset[int], prefix: str = "sampling_parameters.") -> dict[str, np.ndarray]:
    """llm_engine's tensors ([1, 1] scalars, [1, N] word lists) for the parsed vLLM parameters."""
    p = parsed.params
    out: dict[str, np.ndarray] = {
        "temperature": _f32(p.temperature), "top_p": _f32(p.top_p), "top_k": _i32(p.top_k),
        "min_tokens": _i32(p.min_tokens), "repetition_penalty": _f32(p.repetition_penalty),
        "presence_penalty": _f32(p.presence_penalty), "frequency_penalty": _f32(p.frequency_penalty),
        "stream": _bool(stream), "exclude_input_in_output": _bool(True),   # the adapter echoes the prompt text
    }
    if max_tokens_given:
        out["max_tokens"] = _i32(p.max_tokens)
    if p.seed is not None:
        out["seed"] = np.array([[p.seed]], dtype=np.uint64)
    if parsed.n > 1:
        out["num_return_sequences"] = _i32(parsed.n)
    if p.stop:
        out["stop_words"] = _strings(p.stop)
    ignore_eos, end_id = _end_id(parsed.extras.stop_token_ids, p.ignore_eos, eos_ids, prefix)
    if ignore_eos:
        out["ignore_eos"] = _bool(True)
    if end_id is not None:
        out["end_id"] = _i32(end_id)
    if parsed.extras.bad_words:
        out["bad_words"] = _strings(bad_word_variants(parsed.extras.bad_words, tokenizer))
    if p.logit_bias:
        words = bias_words(p.logit_bias, tokenizer, prefix)
        out["embedding_bias_words"] = _strings([w for w, _ in words])
        out["embedding_bias_weights"] = np.array([[b for _, b in words]], dtype=np.float32)
    if want_log_probs:
        out["return_log_probs"] = _bool(True)
    return out


def _end_id(stop_ids: tuple[int, ...], ignore_eos: bool, eos_ids: frozenset[int], prefix: str
            ) -> tuple[bool, int | None]:
    """(ignore_eos, end_id) for llm_engine, whose one end_id replaces the model's EOS and whose
    ignore_eos ignores every end id. vLLM's stop_token_ids end generation in addition to EOS, and
    still end it with ignore_eos. Exact mappings only:
      - no stop ids: ignore_eos as asked, no end_id;
      - ignore_eos with one stop id: end_id = that id, ignore_eos off (EOS is then no end: as asked);
      - without ignore_eos: the ids already among the EOS ids change nothing; one other id would need
        EOS and it both as end ids, which one end_id cannot say: INVALID_ARG.
    """
    ids = tuple(dict.fromkeys(stop_ids))
    if not ids:
        return ignore_eos, None
    if ignore_eos:
        if len(ids) == 1:
            return False, ids[0]
        raise InvalidRequest(prefix + "stop_token_ids", f"with ignore_eos kvshare takes one stop token id (llm_engine "
                                                        f"has one end_id), got {list(ids)}")
    extra = [t for t in ids if t not in eos_ids]
    if not extra:
        return False, None
    raise InvalidRequest(prefix + "stop_token_ids", (
        f"kvshare ends generation on one end id (llm_engine's end_id replaces the model's EOS "
        f"{sorted(eos_ids)}), so {extra} cannot end it in addition to EOS; use stop (text), or "
        f"ignore_eos with a single stop token id"))


def bad_word_variants(words: tuple[str, ...], tokenizer) -> list[str]:
    """vLLM's bad words: each word stripped of leading spaces, plus " " + word when that is a
    different token sequence of the same length (the word in the middle of text)."""
    out: list[str] = []
    for word in words:
        bare = word.lstrip()
        if not bare:
            continue
        out.append(bare)
        if tokenizer is not None:
            ids = tokenizer.encode(bare, add_special_tokens=False)
            spaced = tokenizer.encode(" " + bare, add_special_tokens=False)
            if spaced and ids and spaced[0] != ids[0] and len(spaced) == len(ids):
                out.append(" " + bare)
    return list(dict.fromkeys(out))


def bias_words(bias: tuple[tuple[int, float], ...], tokenizer, prefix: str) -> list[tuple[str, float]]:
    """logit_bias {token id: bias} as llm_engine's (embedding_bias_words, weights): each id as the text
    that tokenizes back to exactly that one token (llm_engine tokenizes each word on its own)."""
    field_name = prefix + "logit_bias"
    if tokenizer is None:
        raise InvalidRequest(field_name, "the served model has no tokenizer")
    vocab = len(tokenizer)
    out = []
    for token, b in bias:
        if not 0 <= token < vocab:
            raise InvalidRequest(field_name, f"token id {token} is outside the vocabulary [0, {vocab})")
        word = tokenizer.decode([token])
        if not word or list(tokenizer.encode(word, add_special_tokens=False)) != [token]:
            raise InvalidRequest(field_name, (
                f"token id {token} ({word!r}) does not tokenize back to itself, and llm_engine takes logit "
                f"bias as words (embedding_bias_words): kvshare cannot bias this token"))
        out.append((word, b))
    return out


# -- llm_engine responses -> vLLM responses -------------------------------------------------------------
@dataclass(frozen=True)
class EngineResponse:
    sequence_index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str                  # "" while running
    cum_log_prob: float | None = None
    log_probs: tuple[float, ...] = ()


def _first(arr):
    v = np.asarray(arr).reshape(-1)
    return v[0] if v.size else None


def engine_response(arrays: Mapping[str, np.ndarray]) -> EngineResponse:
    """One llm_engine response's tensors (name -> numpy) as an EngineResponse."""
    def string(name: str) -> str:
        v = _first(arrays[name]) if name in arrays else None
        if v is None:
            return ""
        return v.decode("utf-8", "replace") if isinstance(v, (bytes, np.bytes_)) else str(v)
    seq = _first(arrays["sequence_index"]) if "sequence_index" in arrays else None
    cum = _first(arrays["cum_log_probs"]) if "cum_log_probs" in arrays else None
    ids = tuple(int(t) for t in np.asarray(arrays["output_ids"]).reshape(-1)) if "output_ids" in arrays else ()
    lps = tuple(float(x) for x in np.asarray(arrays["output_log_probs"]).reshape(-1)) \
        if "output_log_probs" in arrays else ()
    return EngineResponse(sequence_index=0 if seq is None else int(seq), text=string("text_output"), token_ids=ids,
                          finish_reason=string("finish_reason"), cum_log_prob=None if cum is None else float(cum),
                          log_probs=lps)


@dataclass
class _Sequence:
    text: list[str] = field(default_factory=list)      # pending: since the last vLLM response
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    cum_log_prob: float = 0.0


class OutputAssembler:
    """llm_engine responses in, vLLM response tensors (name -> numpy) out.

    add() returns (tensors, last) when a response is due — every engine response when streaming, the
    whole result once every sequence has finished otherwise — and None while holding.
    """

    def __init__(self, request: VLLMRequest, decode_token: Callable[[int], str]):
        self.request = request
        self._decode = decode_token
        self._seqs = [_Sequence() for _ in range(request.n)]

    @property
    def done(self) -> bool:
        return all(s.finish_reason for s in self._seqs)

    def add(self, r: EngineResponse) -> tuple[dict[str, np.ndarray], bool] | None:
        if not 0 <= r.sequence_index < len(self._seqs):
            raise ValueError(f"llm_engine answered sequence {r.sequence_index} of a request of {len(self._seqs)}")
        s = self._seqs[r.sequence_index]
        if s.finish_reason:
            raise ValueError(f"llm_engine answered sequence {r.sequence_index} after its end")
        s.text.append(r.text)
        s.token_ids += r.token_ids
        s.log_probs += r.log_probs
        if r.cum_log_prob is not None:
            s.cum_log_prob = r.cum_log_prob
        s.finish_reason = r.finish_reason
        if not self.request.stream and not self.done:
            return None
        last = self.done
        return self._tensors(), last

    def _tensors(self) -> dict[str, np.ndarray]:
        req = self.request
        echo = req.prompt if req.prepend_input else ""
        out = {"text_output": np.array([(echo + "".join(s.text)).encode("utf-8") for s in self._seqs],
                                       dtype=np.object_)}
        if "return_finish_reason" in req.returns:
            out["finish_reason"] = np.array([_FINISH.get(s.finish_reason, s.finish_reason).encode() for s in self._seqs],
                                            dtype=np.object_)
        if "return_cumulative_logprob" in req.returns:
            out["cumulative_logprob"] = np.array([s.cum_log_prob for s in self._seqs], dtype=np.float32)
        if "return_logprobs" in req.returns:
            out["logprobs"] = np.array([self._logprobs_json(s).encode("utf-8") for s in self._seqs], dtype=np.object_)
        if "return_num_input_tokens" in req.returns:
            out["num_input_tokens"] = np.array([len(req.prompt_ids)], dtype=np.uint32)
        if "return_num_output_tokens" in req.returns:
            out["num_output_tokens"] = np.array([len(s.token_ids) for s in self._seqs], dtype=np.uint32)
        for s in self._seqs:
            s.text.clear()
            s.token_ids.clear()
            s.log_probs.clear()
        return out

    def _logprobs_json(self, s: _Sequence) -> str:
        """vllm_backend's [{token_id: {"logprob", "rank", "decoded_token"}}, ...] for the pending tokens;
        the sampled token only, rank null (llm_engine does not return the top k or the rank)."""
        if self.request.logprobs is None:
            return "null"
        return json.dumps([{t: {"logprob": lp, "rank": None, "decoded_token": self._decode(t)}}
                           for t, lp in zip(s.token_ids, s.log_probs)])


def remap_engine_error(message: str, prefix: str) -> str:
    """llm_engine's "<its input>: ..." as "<prefix><the vLLM key>: ..." (input_ids -> text_input)."""
    name, sep, rest = message.partition(": ")
    if not sep:
        return message
    if name == "input_ids":
        return f"text_input: {rest}"
    if name in _ENGINE_FIELDS:
        return f"{prefix}{_ENGINE_FIELDS[name]}: {rest}"
    return message


# -- cancellation ---------------------------------------------------------------------------------------
class CancelWatch:
    """Polls is_cancelled() of every request in flight from one thread; calls its callback once.

    remove() returns only when no probe of that sender is running, and none runs after it: call it
    before the request's final response goes out.
    """

    def __init__(self, poll_s: float = 0.05):
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[object, Callable[[], None]]] = {}
        self._next = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-model-cancel-watch", daemon=True)
        self._thread.start()

    def add(self, sender, on_cancel: Callable[[], None]) -> int:
        with self._lock:
            self._next += 1
            self._watched[self._next] = (sender, on_cancel)
            return self._next

    def remove(self, token: int) -> None:
        with self._lock:
            self._watched.pop(token, None)

    def close(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    def poll_once(self) -> None:
        with self._lock:
            tokens = list(self._watched)
        for token in tokens:
            fired = None
            with self._lock:
                entry = self._watched.get(token)
                if entry is None:
                    continue
                try:
                    if entry[0].is_cancelled():
                        fired = self._watched.pop(token)[1]
                except Exception:
                    log.debug("is_cancelled failed", exc_info=True)
            if fired is not None:
                try:
                    fired()
                except Exception:
                    log.exception("vllm_model: cancelling a request failed")

    def _run(self) -> None:
        while not self._stopping.wait(self._poll_s):
            self.poll_once()


# -- the Triton model -----------------------------------------------------------------------------------
ENGINE = "llm_engine"
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _cancelled_response():
    return error_response(pb_utils, "Request was cancelled", "CANCELLED")


def _engine_error(err, prefix: str):
    message = err.message() if callable(getattr(err, "message", None)) else str(err)
    remapped = remap_engine_error(message, prefix)
    if remapped == message:
        return pb_utils.InferenceResponse(output_tensors=[], error=err)
    try:
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(remapped, err.code()))
    except Exception:
        return error_response(pb_utils, remapped)


class VLLMResponses:
    """llm_engine's responses to one vllm_model request as vLLM's (bls_stream.Translation)."""

    def __init__(self, request: VLLMRequest, assembler: OutputAssembler, wanted: frozenset[str],
                 stop_watching: Callable[[], None]):
        self._request = request
        self._assembler = assembler
        self._wanted = wanted
        self._stop_watching = stop_watching

    def take(self, response, stream: EngineStream) -> None:
        if stream.cancelled:
            return                # drained: llm_engine ends the request
        if response.has_error():
            stream.send_final(_engine_error(response.error(), self._request.field_prefix))
            if not self._assembler.done:
                stream.cancel()   # the other sequences of n > 1
            return
        arrays = {t.name(): t.as_numpy() for t in response.output_tensors()}
        if not arrays:
            return                # llm_engine's flags-only final
        due = self._assembler.add(engine_response(arrays))
        if due is None:
            return
        tensors, last = due
        reply = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(n, a) for n, a in tensors.items() if n in self._wanted])
        if last:
            stream.send_final(reply)
        else:
            stream.send(reply)

    def end(self, stream: EngineStream) -> None:
        if stream.cancelled:
            stream.send_final(_cancelled_response())
        else:
            stream.send_final(error_response(pb_utils, "vllm_model: llm_engine ended the request before every "
                                                       "sequence finished", "INTERNAL"))

    def before_final(self) -> None:
        self._stop_watching()     # no is_cancelled() probe once the final is out (the stub frees what it reads)


class VLLMTextModel:
    def initialize(self, args):
        configure_logging()
        config = json.loads(args["model_config"])
        self.prompter = TextPrompter(args["model_config"])
        self.eos_ids = self.prompter.stop_ids
        self.output_names = frozenset(o["name"] for o in config["output"])
        self.pool = ThreadPoolExecutor(max_workers=int(self.prompter.params.get("max_streams", "1024")),
                                       thread_name_prefix="vllm-model")
        self.watch = CancelWatch(float(self.prompter.params.get("cancel_poll_s", "0.05")))
        self.engine = EngineLink(pb_utils, self.prompter.params.get("engine_model_name", ENGINE), "vllm_model")

    def execute(self, requests):
        for request in requests:     # read here, on the stub's thread (request_snapshot.py)
            self.pool.submit(self._serve, snapshot_request(request))
        return None

    def finalize(self):
        self.watch.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    def _decode(self, token: int) -> str:
        return self.prompter.tokenizer.decode([token])

    def _read(self, request: RequestSnapshot) -> VLLMRequest:
        return read_request(request.get, request.parameters, tokenize=self.prompter.prompt_ids,
                            tokenizer=self.prompter.tokenizer, eos_ids=self.eos_ids)

    def _serve(self, request: RequestSnapshot) -> None:
        serve_to_the_end(pb_utils, "vllm_model", request, self._stream, log)

    def _stream(self, request: RequestSnapshot, sender) -> None:
        try:
            req = self._read(request)
        except InvalidRequest as exc:
            sender.send(error_response(pb_utils, str(exc)), flags=FINAL)
            return
        except Exception as exc:      # never a crash: the client gets an end
            log.exception("vllm_model: reading the request failed")
            sender.send(error_response(pb_utils, f"vllm_model: {exc}", "INTERNAL"), flags=FINAL)
            return
        inputs = (("input_ids", np.array([req.prompt_ids], dtype=np.int32)),) + req.engine_inputs
        call = EngineCall(inputs=inputs, outputs=tuple(req.engine_outputs()), sequences=req.n)
        stream = EngineStream(self.engine, call, sender, request.request_id)
        token = self.watch.add(sender, stream.cancel)
        # only what the client asked for: Triton 2.51 would drop the rest without the GIL
        # (response_stream.only_requested)
        wanted = request.requested_outputs or self.output_names
        stream.run(VLLMResponses(req, OutputAssembler(req, self._decode), wanted,
                                 stop_watching=lambda: self.watch.remove(token)))
