"""The wire contract's inputs, parsed and validated (no Triton imports: tested without a server).

Every error names the offending input (the name the client sent: an older alias such as
`runtime_top_p` is named as sent), as clients and docs/integrate/contract.md expect. The table of inputs,
their aliases and the unsupported ones is contract.py.

A request with batch dimension B is B GenerationRequests (batch_index b, batch_size B): an input
whose first dimension is B gives row b its row, one whose first dimension is 1 applies to every row,
any other first dimension is INVALID_ARG naming the input.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..engine.outputs import InvalidRequest
from ..sampling_params import SamplingParams
from . import contract

Getter = Callable[[str], "np.ndarray | None"]


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt of a Triton request (a [B, ...] request is B of these, batch_index 0..B-1)."""
    prompt_ids: list[int]
    params: SamplingParams            # bad_words / logit_bias as token ids are filled in by the adapter
    stream: bool
    exclude_input_in_output: bool
    return_num_input_tokens: bool
    return_num_output_tokens: bool
    cache_salt: str
    num_return_sequences: int = 1     # n > 1: n sequences forked from one prefill (sequence_index)
    batch_index: int = 0
    batch_size: int = 1
    return_log_probs: bool = False    # cum_log_probs, output_log_probs
    return_perf_metrics: bool = False  # kv_cache_*_blocks, *_time_ns (and the speculative ones as 0)
    return_context_logits: bool = False
    return_generation_logits: bool = False
    bad_words: tuple[str, ...] = ()   # words as text (empty strings dropped): tokenized by the adapter
    embedding_bias: tuple[tuple[str, float], ...] = ()   # (word, weight): every token of the word gets weight
    pad_id: int | None = None         # pads beams of unequal length in output_ids


# -- one row's inputs, aliases resolved -------------------------------------------------------------------
class _Row:
    """Reads one row's inputs by their current name; an older alias is read (and named) when sent instead."""

    def __init__(self, get: Getter):
        self._get = get

    def raw(self, name: str) -> tuple[str, np.ndarray | None]:
        sent = [(n, a) for n in (name,) + contract.ALIASES.get(name, ()) if (a := self._get(n)) is not None]
        if not sent:
            return name, None
        if len(sent) > 1:
            names = " and ".join(n for n, _ in sent)
            raise InvalidRequest(sent[1][0], f"{names} are the same input (old and new name): send one of them")
        return sent[0]

    def scalar(self, name: str):
        sent, arr = self.raw(name)
        if arr is None:
            return sent, None
        if arr.size != 1:
            raise InvalidRequest(sent, f"expected one value (shape [1] or [1,1]), got shape {list(arr.shape)}")
        return sent, arr.reshape(-1)[0]

    def bool(self, name: str, default: bool) -> bool:
        sent, v = self.scalar(name)
        if v is None:
            return default
        if isinstance(v, (bytes, str, np.bytes_, np.str_)):
            raise InvalidRequest(sent, f"must be BOOL, got a string")
        return bool(v)

    def int(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        sent, v = self.scalar(name)
        if v is None:
            return default
        v = _as_int(sent, v)
        if lo is not None and v < lo:
            raise InvalidRequest(sent, f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise InvalidRequest(sent, f"must be <= {hi}, got {v}")
        return v

    def float(self, name: str, default: float | None) -> float | None:
        sent, v = self.scalar(name)
        if v is None:
            return default
        return _as_float(sent, v)

    def sent_name(self, name: str) -> str:
        return self.raw(name)[0]

    def given(self, name: str) -> bool:
        return self.raw(name)[1] is not None

    def words(self, name: str) -> tuple[str, ...]:
        """A STRING [-1] list: one word per element; empty strings mean "none" and are dropped."""
        return tuple(w for w in self.strings(name) if w)

    def strings(self, name: str) -> tuple[str, ...]:
        sent, arr = self.raw(name)
        if arr is None:
            return ()
        _check_strings(sent, arr)
        if arr.ndim > 2 or (arr.ndim == 2 and arr.shape[0] != 1):
            raise InvalidRequest(sent, f"expected a list of strings, shape [N] or [1,N]; got {list(arr.shape)}")
        return tuple(decode_utf8(w, sent) for w in arr.reshape(-1))


def _as_int(name: str, v) -> int:
    if isinstance(v, (bytes, str, np.bytes_, np.str_)):
        raise InvalidRequest(name, "must be an integer, got a string")
    if isinstance(v, (float, np.floating)):
        if not float(v).is_integer():
            raise InvalidRequest(name, f"must be an integer, got {v}")
    return int(v)


def _as_float(name: str, v) -> float:
    if isinstance(v, (bytes, str, np.bytes_, np.str_)):
        raise InvalidRequest(name, "must be a number, got a string")
    v = float(v)
    if not math.isfinite(v):
        raise InvalidRequest(name, f"must be a finite number, got {v}")
    return v


def _check_strings(name: str, arr: np.ndarray) -> None:
    if arr.dtype != np.object_ and arr.dtype.kind not in ("S", "U"):
        raise InvalidRequest(name, f"must be STRING (BYTES), got {arr.dtype}")


def decode_utf8(raw: bytes | str, name: str) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(name, f"is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except TypeError:
        raise InvalidRequest(name, f"must be STRING (BYTES), got {type(raw).__name__}") from None


# -- batch rows -------------------------------------------------------------------------------------------
def _has_batch_dim(name: str, arr: np.ndarray) -> bool:
    t = contract.BY_NAME.get(name)
    if t is None or t.dims == (1,):
        return arr.ndim >= 1          # [B,1], or [B] (a reshape [] scalar)
    return arr.ndim == len(t.dims) + 1


def batch_rows(get: Getter, batch_size: int) -> list[Getter]:
    """B getters, one per row: a [B, ...] input gives row b arr[b:b+1]; a [1, ...] one applies to all."""
    checked: dict[str, np.ndarray | None] = {}

    def whole(name: str):
        if name not in checked:
            arr = get(name)
            if arr is not None:
                arr = np.asarray(arr)
                if _has_batch_dim(name, arr) and arr.shape[0] not in (1, batch_size):
                    raise InvalidRequest(name, f"has batch dimension {arr.shape[0]}, but the request has {batch_size} "
                                               f"rows: send 1 (applies to every row) or {batch_size}")
            checked[name] = arr
        return checked[name]

    def row(b: int) -> Getter:
        def get_row(name: str):
            arr = whole(name)
            if arr is None or batch_size == 1 or not _has_batch_dim(name, arr) or arr.shape[0] == 1:
                return arr
            return arr[b:b + 1]
        return get_row

    # Every input's batch dimension is checked up front, so a bad one is refused whichever row reads it.
    for t in contract.INPUTS:
        whole(t.name)
    return [row(b) for b in range(batch_size)]


def _batch_size_of(name: str, arr: np.ndarray) -> int:
    if arr.ndim == 0:
        return 1
    if name == "input_ids":
        if arr.ndim == 1:
            return 1
        if arr.ndim != 2:
            raise InvalidRequest("input_ids", f"expected shape [B, L], got {list(arr.shape)}")
    b = int(arr.shape[0])
    if b == 0:
        raise InvalidRequest(name, "has no rows (batch dimension 0)")
    if b > contract.ENGINE_MAX_BATCH_SIZE:
        raise InvalidRequest(name, f"batch size {b} exceeds {contract.ENGINE_MAX_BATCH_SIZE}")
    return b


# -- the inputs -------------------------------------------------------------------------------------------
def text_input(get: Getter, name: str = "text_input", max_bytes: int | None = None) -> str:
    """One prompt's text (a row getter, or a request of one row); longer than max_bytes is refused
    before it is decoded or tokenized."""
    sent, v = _Row(get).scalar(name)
    if v is None:
        raise InvalidRequest(name, "is required")
    check_prompt_bytes(v, name, max_bytes)
    text = decode_utf8(v, name)
    if not text.strip():
        raise InvalidRequest(name, "is empty")
    return text


def check_prompt_bytes(raw, name: str, max_bytes: int | None) -> None:
    if max_bytes is None or not isinstance(raw, (bytes, np.bytes_, str, np.str_)):
        return
    size = len(raw.encode("utf-8")) if isinstance(raw, str) else len(raw)
    if size > max_bytes:
        raise InvalidRequest(name, f"has {size} bytes, more than max_prompt_bytes ({max_bytes})")


def stop_words(get: Getter) -> tuple[str, ...]:
    return _Row(get).words("stop_words")


def _sampling(r: _Row, *, default_max_tokens: int) -> tuple[SamplingParams, dict]:
    """SamplingParams of one row, plus the GenerationRequest fields read alongside (validated together)."""
    max_tokens = r.int("max_tokens", default_max_tokens)
    if max_tokens <= 0:
        raise InvalidRequest(r.sent_name("max_tokens"), f"must be > 0, got {max_tokens}")
    temperature = r.float("temperature", 1.0)
    if temperature < 0:
        raise InvalidRequest("temperature", f"must be >= 0, got {temperature}")
    top_k = r.int("top_k", 0, lo=0)
    top_p = r.float("top_p", None)
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise InvalidRequest(r.sent_name("top_p"), f"must be in [0, 1], got {top_p}")
    if top_p == 0.0:               # TensorRT-LLM: top_p 0 is off; with top_k 0 too, greedy (top_k 1)
        top_p, top_k = 1.0, top_k or 1
    top_p = 1.0 if top_p is None else top_p
    repetition = r.float("repetition_penalty", 1.0)
    if repetition <= 0:
        raise InvalidRequest("repetition_penalty", f"must be > 0, got {repetition}")
    presence = r.float("presence_penalty", 0.0)
    frequency = r.float("frequency_penalty", 0.0)
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= v <= 2.0:
            raise InvalidRequest(name, f"must be in [-2, 2], got {v}")
    length_penalty = r.float("length_penalty", 1.0)
    min_tokens = r.int("min_tokens", 0, lo=0)
    seed = r.int("seed", None, lo=0, hi=2 ** 64 - 1)
    stop = r.words("stop_words")
    bad = r.words("bad_words")

    end_id = r.int("end_id", None, lo=-1)
    end_ids = None if end_id is None else (() if end_id == -1 else (end_id,))
    pad_id = r.int("pad_id", None, lo=-1)

    beam_width = r.int("beam_width", 1)
    if not 1 <= beam_width <= contract.MAX_BEAM_WIDTH:
        raise InvalidRequest("beam_width", f"must be in [1, {contract.MAX_BEAM_WIDTH}], got {beam_width}")
    n = r.int("num_return_sequences", None)
    if n is not None and not 1 <= n <= contract.MAX_RETURN_SEQUENCES:
        raise InvalidRequest("num_return_sequences", f"must be in [1, {contract.MAX_RETURN_SEQUENCES}], got {n}")
    if beam_width > 1:
        if n is not None and n > beam_width:
            raise InvalidRequest("num_return_sequences", f"({n}) must be <= beam_width ({beam_width}): beam search "
                                                         f"returns at most beam_width beams")
        n = beam_width if n is None else n
    n = 1 if n is None else n

    words, weights = r.strings("embedding_bias_words"), r.raw("embedding_bias_weights")[1]
    weights = () if weights is None else tuple(_as_float("embedding_bias_weights", w) for w in
                                               np.asarray(weights).reshape(-1))
    if len(words) != len(weights):
        raise InvalidRequest("embedding_bias_words", f"has {len(words)} words but embedding_bias_weights has "
                                                     f"{len(weights)} weights: send one weight per word")
    bias = tuple((w, x) for w, x in zip(words, weights) if w)

    return_log_probs = r.bool("return_log_probs", False)
    return_context_logits = r.bool("return_context_logits", False)
    return_generation_logits = r.bool("return_generation_logits", False)

    if beam_width > 1:
        # The engine's beam search (engine.beam_search) is deterministic on the raw log-probabilities.
        why = "beam search (beam_width > 1) is deterministic and ranks beams by the raw log-probabilities"
        if temperature not in (0.0, 1.0):
            raise InvalidRequest("temperature", f"must be 0 or 1 with beam_width {beam_width} ({why}), got "
                                                f"{temperature}")
        if top_k not in (0, 1):
            raise InvalidRequest(r.sent_name("top_k"), f"must be 0 or 1 with beam_width {beam_width} ({why}), "
                                                       f"got {top_k}")
        if top_p != 1.0:
            raise InvalidRequest(r.sent_name("top_p"), f"must be 0 or 1 with beam_width {beam_width} ({why}), "
                                                       f"got {top_p}")
        for name, off in (("stop_words", not stop), ("bad_words", not bad), ("embedding_bias_words", not bias),
                          ("repetition_penalty", repetition == 1.0), ("presence_penalty", presence == 0.0),
                          ("frequency_penalty", frequency == 0.0), ("min_tokens", min_tokens == 0),
                          ("return_generation_logits", not return_generation_logits),
                          ("return_context_logits", not return_context_logits)):
            if not off:
                raise InvalidRequest(r.sent_name(name), f"is not supported with beam_width > 1 (kvshare's beam "
                                                        f"search does not apply it)")
        temperature, top_k = 0.0, 0

    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        min_tokens=min_tokens, seed=seed, repetition_penalty=repetition, presence_penalty=presence,
        frequency_penalty=frequency, stop=stop, ignore_eos=r.bool("ignore_eos", False), end_ids=end_ids,
        logprobs=0 if return_log_probs else -1, return_generation_logits=return_generation_logits,
        return_context_logits=return_context_logits, beam_width=beam_width, length_penalty=length_penalty)
    salt = r.scalar("cache_salt")[1]
    fields = dict(
        stream=r.bool("stream", False),
        exclude_input_in_output=r.bool("exclude_input_in_output", True),
        return_num_input_tokens=r.bool("return_num_input_tokens", False),
        return_num_output_tokens=r.bool("return_num_output_tokens", False),
        cache_salt="" if salt is None else decode_utf8(salt, "cache_salt"),
        num_return_sequences=n,
        return_log_probs=return_log_probs,
        return_perf_metrics=r.bool("return_perf_metrics", False),
        return_context_logits=return_context_logits,
        return_generation_logits=return_generation_logits,
        bad_words=bad,
        embedding_bias=bias,
        pad_id=pad_id,
    )
    return params, fields


def sampling_params(get: Getter, *, default_max_tokens: int) -> SamplingParams:
    """The SamplingParams of a one-row request (or of one row's getter)."""
    return _sampling(_Row(get), default_max_tokens=default_max_tokens)[0]


def _rows(get: Getter, lead: str) -> list[Getter]:
    arr = get(lead)
    if arr is None:
        raise InvalidRequest(lead, "is required")
    arr = np.asarray(arr)
    contract.refuse_unsupported(get)
    return batch_rows(get, _batch_size_of(lead, arr))


def text_prompts(get: Getter, max_prompt_bytes: int | None = None) -> list[str]:
    """The B prompt texts of a text-model request, after validating every input of every row."""
    rows = _rows(get, "text_input")
    texts = []
    for row in rows:
        texts.append(text_input(row, max_bytes=max_prompt_bytes))
        _sampling(_Row(row), default_max_tokens=1)
        _Row(row).bool("apply_chat_template", False)
    return texts


def _row_prompt_ids(get: Getter, b: int, batch_size: int) -> list[int]:
    arr = get("input_ids")
    if arr.dtype.kind not in ("i", "u"):
        raise InvalidRequest("input_ids", f"must be INT32 token ids, got {arr.dtype}")
    ids = arr.reshape(-1).astype(np.int64).tolist()
    lengths = get("input_lengths")
    if lengths is not None:
        if lengths.size != 1:
            raise InvalidRequest("input_lengths", f"expected one value per row, got shape {list(lengths.shape)}")
        n = _as_int("input_lengths", lengths.reshape(-1)[0])
        if not 0 <= n <= len(ids):
            raise InvalidRequest("input_lengths", f"row {b}: {n} is outside [0, {len(ids)}] (the row's length)")
        ids = ids[:n]
    if not ids:
        raise InvalidRequest("input_ids", "is empty" if batch_size == 1 else f"row {b} is empty")
    return ids


def prompt_ids(get: Getter) -> list[int]:
    """The token ids of a one-row llm_engine request."""
    reqs = [_row_prompt_ids(row, b, len(rows)) for rows in [_rows(get, "input_ids")] for b, row in enumerate(rows)]
    if len(reqs) != 1:
        raise InvalidRequest("input_ids", f"expected one prompt, got {len(reqs)}")
    return reqs[0]


def generation_requests(get: Getter, *, default_max_tokens: int) -> list[GenerationRequest]:
    """llm_engine's request (input_ids [B,L] or [L], optional input_lengths [B,1]): B GenerationRequests."""
    rows = _rows(get, "input_ids")
    out = []
    for b, row in enumerate(rows):
        ids = _row_prompt_ids(row, b, len(rows))
        params, fields = _sampling(_Row(row), default_max_tokens=default_max_tokens)
        out.append(GenerationRequest(prompt_ids=ids, params=params, batch_index=b, batch_size=len(rows), **fields))
    return out


def generation_request(get: Getter, *, default_max_tokens: int) -> GenerationRequest:
    """A one-row llm_engine request (kept for callers that do not split batches yet)."""
    reqs = generation_requests(get, default_max_tokens=default_max_tokens)
    if len(reqs) != 1:
        raise InvalidRequest("input_ids", f"batch size must be 1 here, got {len(reqs)}")
    return reqs[0]
