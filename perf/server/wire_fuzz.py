"""The wire-contract fuzzer: random requests to every model of the real Triton server.

Every model (`ensemble`, `llm_bls`, `llm_engine`, `vllm_model`, `preprocessing`) gets random subsets
of the inputs its config declares (read from kvshare.triton_adapter.contract, the table the configs
are generated from), with random dtypes, shapes (batch 0 .. max_batch_size + 1, empty, huge) and
values (NaN, +-inf, negative, 2**31 - 1, invalid UTF-8, 1 MB strings), over gRPC streaming, gRPC
unary and HTTP generate / generate_stream. The property of one request:

  - it ends within the deadline with exactly one final response (nothing after it), or with an
    error that names an input (or is one of Triton's own refusals: batch size, decoupled model over
    unary gRPC, unparsable JSON, overload);
  - no internal error (a Python exception text, "generation failed", a dead stub);
  - the server is still ready afterwards.

After a run, no KV page is referenced (kvshare_kv_pages_active 0) and free + cached = total.

    python -m perf.server.wire_fuzz --minutes 30                  # starts its own server
    python -m perf.server.wire_fuzz --minutes 5 --grpc-url 127.0.0.1:8001 --http-url http://127.0.0.1:8000 \\
        --metrics-url http://127.0.0.1:8002/metrics

tests/backend/integration/test_wire_fuzz.py runs a derandomized CI-sized slice of the same
strategies against the test session's server.
"""
from __future__ import annotations

import argparse
import json
import math
import queue
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from kvshare.triton_adapter import contract as C
from kvshare.triton_adapter.vllm_params import KEY_DOCS

MODELS = (C.ENSEMBLE, C.BLS, C.ENGINE, C.VLLM, C.PREPROCESSING)
PROTOCOLS = ("grpc_stream", "grpc_unary", "http_generate", "http_generate_stream")
DECOUPLED = frozenset({C.ENSEMBLE, C.BLS, C.ENGINE, C.VLLM})   # gRPC unary answers UNIMPLEMENTED
MAX_NEW_TOKENS = 3          # keeps a generating request to a few engine steps on the CPU
VOCAB = 49152               # the embedded SmolLM2's; ids past it must be refused
ONE_MB = 1_000_000
OVER_LIMIT = (1 << 20) + 1  # one byte past the text models' default max_prompt_bytes

DTYPES = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64", "TYPE_UINT64": "UINT64",
          "TYPE_UINT8": "UINT8", "TYPE_FP32": "FP32", "TYPE_FP16": "FP16", "TYPE_BOOL": "BOOL"}
NUMPY = {"BYTES": np.object_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "UINT8": np.uint8,
         "FP32": np.float32, "FP16": np.float16, "BOOL": np.bool_}

# Triton's own refusals, which come before any kvshare code sees the request and name no input.
FRAMEWORK_REFUSALS = ("batch-size must be", "doesn't support models with decoupled", "Unable to parse",
                      "failed to parse", "is overloaded", "Received message larger than max",
                      "unexpected number of inputs", "JSON", "expected", "must specify", "does not support",
                      "request has 0 inputs", "has invalid type")
# Text that only an unhandled exception or a broken server puts in an error.
INTERNAL_MARKERS = ("Traceback", "object has no attribute", "Stub process", "not healthy", "generation failed",
                    "llm_bls: ", "vllm_model: ", "NoneType", "index out of", "IndexError", "KeyError",
                    "TypeError", "ValueError", "AttributeError", "RuntimeError", "Socket closed", "UNAVAILABLE:")


# -- requests ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WireTensor:
    name: str
    dtype: str                  # Triton wire dtype: BYTES, INT32, ...
    array: np.ndarray


@dataclass(frozen=True)
class FuzzRequest:
    model: str
    protocol: str
    tensors: tuple[WireTensor, ...]
    parameters: tuple[tuple[str, object], ...] = ()    # request parameters (vllm_model reads them)

    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def describe(self) -> str:
        def one(t: WireTensor) -> str:
            flat = t.array.reshape(-1)
            head = ", ".join(_short(v) for v in flat[:3]) + (", ..." if flat.size > 3 else "")
            return f"{t.name}:{t.dtype}{list(t.array.shape)}=[{head}]"
        params = f" parameters={dict(self.parameters)}" if self.parameters else ""
        return f"{self.model} over {self.protocol}: " + " ".join(one(t) for t in self.tensors) + params


def _short(v) -> str:
    if isinstance(v, bytes):
        return repr(v[:24] + (b"..." if len(v) > 24 else b"")) + (f"({len(v)} B)" if len(v) > 24 else "")
    return repr(v.item() if hasattr(v, "item") else v)


def _declared(model: str) -> list[C.Tensor]:
    return C.inputs_of(model)


def _lead(model: str) -> str:
    return "input_ids" if model == C.ENGINE else "text_input"


_INT_EDGES = (0, 1, -1, 2, 3, 7, 2 ** 31 - 1, -2 ** 31)
_UINT_EDGES = (0, 1, 2, 2 ** 63, 2 ** 64 - 1)
_FLOAT_EDGES = (0.0, 0.5, 1.0, -1.0, 2.0, -0.0, math.nan, math.inf, -math.inf, 1e30, -1e30, 1e-30, 3.4e38)
_TEXT = (b"hi", b"The capital of France is", b"", b" ", b"\xff\xfe", b"caf\xe9", "日本語 🙂".encode(), b"\x00",
         b"none", b"{}", b'{"max_tokens": 2}', b"stop")


def _values(draw, dtype: str, n: int, *, name: str, allow_huge: bool) -> list:
    if dtype == "BYTES":
        def text():
            if allow_huge and draw(st.integers(0, 29)) == 0:
                return b"a" * draw(st.sampled_from((ONE_MB, OVER_LIMIT)))
            if name == "sampling_parameters":
                return json.dumps(draw(_sampling_json())).encode()
            return draw(st.one_of(st.sampled_from(_TEXT), st.binary(max_size=12),
                                  st.text(max_size=12).map(lambda s: s.encode("utf-8", "surrogatepass"))))
        return [text() for _ in range(n)]
    if dtype == "BOOL":
        return draw(st.lists(st.booleans(), min_size=n, max_size=n))
    if dtype in ("FP32", "FP16"):
        return draw(st.lists(st.one_of(st.sampled_from(_FLOAT_EDGES), st.floats(-3, 3, width=16)),
                             min_size=n, max_size=n))
    if dtype == "UINT64":
        return draw(st.lists(st.one_of(st.sampled_from(_UINT_EDGES), st.integers(0, 100)), min_size=n, max_size=n))
    if dtype == "UINT8":
        return draw(st.lists(st.integers(0, 255), min_size=n, max_size=n))
    if name in ("input_ids", "end_id", "pad_id"):
        small = st.integers(0, VOCAB - 1)
        edge = st.sampled_from((-1, VOCAB, 2 ** 31 - 1, -2 ** 31))
        return draw(st.lists(st.one_of(small, small, small, edge), min_size=n, max_size=n))
    hi = 2 ** 31 - 1 if dtype == "INT32" else 2 ** 63 - 1
    return draw(st.lists(st.one_of(st.sampled_from(_INT_EDGES), st.integers(-4, 9), st.integers(-hi - 1, hi)),
                         min_size=n, max_size=n))


def _array(dtype: str, values: list, shape: tuple[int, ...]) -> np.ndarray:
    np_type = NUMPY[dtype]
    if dtype == "BYTES":
        arr = np.empty(len(values), dtype=np.object_)
        arr[:] = values
        return arr.reshape(shape)
    if dtype in ("INT32", "INT64", "UINT64", "UINT8"):
        info = np.iinfo(np_type)
        values = [min(max(int(v), info.min), info.max) for v in values]
    with np.errstate(over="ignore"):
        return np.array(values, dtype=np_type).reshape(shape)


# Values a well-behaved client sends (a plausible request reaches generation, and its pages the pool).
PLAUSIBLE: dict[str, tuple] = {
    "text_input": (b"hi", b"The capital of France is", "日本語 🙂".encode(), b"Count: one, two,"),
    "temperature": (0.0, 0.7, 1.0), "top_p": (0.0, 0.9, 1.0), "top_k": (0, 1, 5), "runtime_top_k": (0, 1, 5),
    "runtime_top_p": (0.0, 0.9, 1.0), "min_tokens": (0, 1), "min_length": (0, 1), "seed": (0, 7), "random_seed": (0, 7),
    "beam_width": (1, 1, 2), "num_return_sequences": (1, 2), "repetition_penalty": (1.0, 1.2),
    "presence_penalty": (0.0, 0.5), "frequency_penalty": (0.0, -0.5), "length_penalty": (1.0, 0.5),
    "end_id": (2, -1), "pad_id": (2, -1), "stop_words": (b"", b",", b" two"), "bad_words": (b"", b" one"),
    "embedding_bias_words": (b"",), "embedding_bias_weights": (0.0,), "cache_salt": (b"", b"tenant-a", b"tenant-b"),
    "max_tokens": (1, 2, 3), "request_output_len": (1, 2, 3),
}


@st.composite
def _tensor(draw, spec: C.Tensor, model: str, batch: int, lead_len: int, plausible: bool) -> WireTensor:
    declared = DTYPES[spec.dtype]
    wrong = sorted(set(DTYPES.values()) - {declared})
    dtype = declared if plausible else draw(st.sampled_from([declared] * 12 + wrong))
    dims = []
    for d in spec.dims:
        if d == -1:
            length = lead_len if spec.name == "input_ids" else (
                1 if plausible else draw(st.sampled_from((0, 1, 1, 2, 3, 300))))
            dims.append(length)
        else:
            dims.append(d if plausible else draw(st.sampled_from((d,) * 12 + (0, 2))))
    if model != C.VLLM:
        rows = batch if plausible else draw(st.sampled_from((batch,) * 12 + (1, 2)))
        dims = [rows] + dims
    if plausible and dtype == declared:
        n = int(np.prod(dims)) if dims else 1
        if spec.name in PLAUSIBLE:
            values = [draw(st.sampled_from(PLAUSIBLE[spec.name])) for _ in range(n)]
        elif spec.role == "unsupported":
            values = [b"" if dtype == "BYTES" else 0] * n
        elif dtype == "BOOL":
            values = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        else:
            values = _values(draw, dtype, n, name=spec.name, allow_huge=False)
        if spec.name == "input_ids":
            values = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
        if spec.name == "sampling_parameters":
            values = [json.dumps({"max_tokens": 2, "temperature": 0}).encode()] * n
        if spec.role == "unsupported" and dtype in ("FP16", "UINT8", "INT64"):
            dims = dims[:1] + [0] * (len(dims) - 1) if model != C.VLLM else [0] * len(dims)   # empty: neutral
            values = values[:int(np.prod(dims))]
        return WireTensor(spec.name, dtype, _array(dtype, values, tuple(dims)))
    while int(np.prod(dims)) > 4096:     # keeps one request's tensors a few MB at most
        i = int(np.argmax(dims))
        dims[i] //= 2
    n = int(np.prod(dims)) if dims else 1
    values = _values(draw, dtype, n, name=spec.name, allow_huge=(n == 1))
    return WireTensor(spec.name, dtype, _array(dtype, values, tuple(dims)))


def _small_max_tokens(model: str, batch: int) -> WireTensor:
    shape = (batch, 1) if model != C.VLLM else (1,)
    return WireTensor("max_tokens", "INT32", np.full(shape, 2, dtype=np.int32))


def _sampling_json():
    """vLLM sampling_parameters: any of its keys with odd values, max_tokens kept small when valid."""
    value = st.one_of(st.sampled_from((None, True, False, 0, 1, -1, 2, 0.5, -0.5, 1e9, "1", "true", "x", "")),
                      st.integers(-2 ** 63, 2 ** 64), st.floats(allow_nan=False, allow_infinity=False),
                      st.lists(st.one_of(st.integers(-2, VOCAB + 1), st.text(max_size=4)), max_size=3),
                      st.dictionaries(st.sampled_from(("1", "2", "x", "-5")), st.floats(-10, 10), max_size=2))
    keys = st.dictionaries(st.sampled_from(sorted(KEY_DOCS) + ["unknown_key"]), value, max_size=4)
    return keys.flatmap(lambda d: st.sampled_from((
        {**d, "max_tokens": MAX_NEW_TOKENS}, {**d, "max_tokens": MAX_NEW_TOKENS}, {**d, "max_tokens": 1}, d)))


def _request_parameters():
    """vllm_model's fallback: vLLM keys as request parameters, which carry only int, bool and string."""
    value = st.one_of(st.sampled_from((True, False, 0, 1, -1, 2, "0.5", "-1", "1e9", "true", "x", "", "[1, 2]")),
                      st.integers(-2 ** 63, 2 ** 63 - 1), st.floats(allow_nan=True).map(str))
    keys = st.dictionaries(st.sampled_from(sorted(KEY_DOCS) + ["unknown_key", "stream", "return_logprobs"]), value,
                           max_size=4)
    return keys.flatmap(lambda d: st.sampled_from((
        {**d, "max_tokens": MAX_NEW_TOKENS}, {**d, "max_tokens": MAX_NEW_TOKENS}, {**d, "max_tokens": "1"}, d)))


@st.composite
def fuzz_requests(draw, model: str | None = None, protocol: str | None = None) -> FuzzRequest:
    """One request: the model's lead input (mostly), a random subset of its other declared inputs."""
    model = model or draw(st.sampled_from(MODELS))
    # Unary gRPC to a decoupled model is refused by Triton before kvshare sees it: drawn rarely.
    unary = 1 if model in DECOUPLED else 3
    protocol = protocol or draw(st.sampled_from(("grpc_stream",) * 4 + ("grpc_unary",) * unary
                                                + ("http_generate", "http_generate_stream") * 2))
    declared = _declared(model)
    limit = C.ENGINE_MAX_BATCH_SIZE if model == C.ENGINE else C.MAX_BATCH_SIZE
    plausible = draw(st.booleans())
    batch = 1 if model == C.VLLM else draw(st.sampled_from((1,) * 8 + (2, 3) + ((4,) if plausible else
                                                                                  (0, limit, limit + 1))))
    lead_len = draw(st.sampled_from((1, 2, 5, 8) + (() if plausible else (0, 9000))))
    lead = _lead(model)
    names = [lead] if plausible or draw(st.integers(0, 9)) else []
    others = [t.name for t in declared if t.name != lead and t.role not in ("control", "alias" if plausible else "")]
    names += draw(st.lists(st.sampled_from(others), max_size=4, unique=True))
    by_name = {t.name: t for t in declared}
    tensors = [draw(_tensor(by_name[n], model, batch, lead_len, plausible)) for n in names]
    parameters: dict[str, object] = {}
    if model == C.VLLM:
        if "sampling_parameters" not in names:
            parameters = draw(_request_parameters())
    elif not {"max_tokens", "request_output_len"} & set(names) and batch > 0:
        tensors.append(_small_max_tokens(model, batch))
    return FuzzRequest(model, protocol, tuple(tensors), tuple(sorted(parameters.items())))


# -- outcomes ---------------------------------------------------------------------------------------------
GOOD = ("ok", "refused")


@dataclass(frozen=True)
class Outcome:
    kind: str                   # ok, refused, unclear_error, internal_error, no_final, after_final, timeout, transport
    detail: str = ""
    responses: int = 0
    seconds: float = 0.0


def known_names(model: str) -> set[str]:
    names = {t.name for t in _declared(model)} | {"text_input", "input_ids"}
    if model == C.VLLM:
        names |= {f"sampling_parameters.{k}" for k in KEY_DOCS} | {f"parameters.{k}" for k in KEY_DOCS}
    return names


def classify_error(model: str, message: str) -> str:
    if any(m in message for m in INTERNAL_MARKERS):
        return "internal_error"
    if any(n in message for n in known_names(model)):
        return "refused"
    if model == C.VLLM and message.startswith(("parameters.", "sampling_parameters.")):
        return "refused"            # a key the client sent, known to vLLM or not
    if any(p in message for p in FRAMEWORK_REFUSALS):
        return "refused"
    return "unclear_error"


def _grpc_inputs(grpcclient, req: FuzzRequest) -> list:
    out = []
    for t in req.tensors:
        x = grpcclient.InferInput(t.name, list(t.array.shape), t.dtype)
        x.set_data_from_numpy(t.array)
        out.append(x)
    return out


def _grpc_stream(url: str, req: FuzzRequest, timeout: float) -> Outcome:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    events: queue.Queue = queue.Queue()
    seen: list = []

    def on_response(result, error):
        seen.append((result, error))
        events.put((result, error))

    start = time.monotonic()
    client.start_stream(callback=on_response)
    try:
        client.async_stream_infer(req.model, _grpc_inputs(grpcclient, req), request_id="fuzz",
                                  parameters=dict(req.parameters) or None, enable_empty_final_response=True)
        end: Outcome | None = None
        count = 0
        while end is None:
            left = timeout - (time.monotonic() - start)
            try:
                result, error = events.get(timeout=max(0.0, left))
            except queue.Empty:
                return Outcome("timeout", f"no final response after {timeout:.0f} s ({count} responses)", count,
                               time.monotonic() - start)
            count += 1
            if error is not None:
                msg = error.message() if hasattr(error, "message") else str(error)
                end = Outcome(classify_error(req.model, msg), msg, count)
            elif result.get_response().parameters["triton_final_response"].bool_param:
                end = Outcome("ok", "", count)
    finally:
        client.stop_stream()        # returns when the server has closed the stream: late responses are in `seen`
        client.close()
    seconds = time.monotonic() - start
    if len(seen) > end.responses:
        return Outcome("after_final", f"{len(seen) - end.responses} responses after the final one", len(seen),
                       seconds)
    return Outcome(end.kind, end.detail, end.responses, seconds)


def _grpc_unary(url: str, req: FuzzRequest, timeout: float) -> Outcome:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    start = time.monotonic()
    with grpcclient.InferenceServerClient(url) as client:
        try:
            client.infer(req.model, _grpc_inputs(grpcclient, req), parameters=dict(req.parameters) or None,
                         client_timeout=timeout)
        except InferenceServerException as exc:
            msg = exc.message() or str(exc)
            kind = "timeout" if "Deadline Exceeded" in msg else classify_error(req.model, msg)
            return Outcome(kind, msg, 1, time.monotonic() - start)
    return Outcome("ok", "", 1, time.monotonic() - start)


def _json_value(arr: np.ndarray):
    def one(v):
        if isinstance(v, bytes):
            return v.decode("utf-8", "replace")
        if isinstance(v, (np.floating, float)):
            return float(v)
        if isinstance(v, (np.bool_, bool)):
            return bool(v)
        return int(v)
    flat = [one(v) for v in arr.reshape(-1)]
    return flat[0] if len(flat) == 1 else flat


def http_body(req: FuzzRequest) -> bytes:
    """The generate extension's body: a top-level key per input (a scalar, or a list for [-1] inputs)
    and per request parameter; NaN and infinities go out as JSON's NaN/Infinity tokens (invalid JSON)."""
    body = {k: v for k, v in req.parameters}
    body.update({t.name: _json_value(t.array) for t in req.tensors})
    return json.dumps(body).encode()


def _http(base: str, req: FuzzRequest, timeout: float, stream: bool) -> Outcome:
    url = f"{base}/v2/models/{req.model}/{'generate_stream' if stream else 'generate'}"
    request = urllib.request.Request(url, data=http_body(req), method="POST",
                                     headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            status, text = r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode("utf-8", "replace")
    except TimeoutError:
        return Outcome("timeout", f"no answer after {timeout:.0f} s", 0, time.monotonic() - start)
    except (urllib.error.URLError, ConnectionError) as e:
        return Outcome("transport", str(e), 0, time.monotonic() - start)
    seconds = time.monotonic() - start
    if stream:
        events = [e for e in text.split("\n\n") if e.strip()]
        if not events:
            return Outcome("no_final", f"HTTP {status}: an empty event stream", 0, seconds)
        parsed = []
        for e in events:
            try:
                parsed.append(json.loads(e.removeprefix("data: ")))
            except ValueError:
                return Outcome("unclear_error", f"HTTP {status}: not an event: {e[:200]}", len(events), seconds)
        errors = [p["error"] for p in parsed if isinstance(p, dict) and "error" in p]
        if errors:
            if len(errors) > 1 or "error" not in parsed[-1]:
                return Outcome("after_final", f"events after an error: {text[:300]}", len(events), seconds)
            return Outcome(classify_error(req.model, errors[0]), errors[0], len(events), seconds)
        return Outcome("ok", "", len(events), seconds)
    try:
        parsed = json.loads(text)
    except ValueError:
        return Outcome("unclear_error", f"HTTP {status}: not JSON: {text[:200]}", 1, seconds)
    if status == 200 and "error" not in parsed:
        return Outcome("ok", "", 1, seconds)
    message = str(parsed.get("error", text))
    return Outcome(classify_error(req.model, message), message, 1, seconds)


@dataclass(frozen=True)
class Urls:
    grpc: str                   # host:port
    http: str                   # http://host:port
    metrics: str                # http://host:port/metrics


def send(urls: Urls, req: FuzzRequest, timeout: float = 120.0) -> Outcome:
    try:
        if req.protocol == "grpc_stream":
            return _grpc_stream(urls.grpc, req, timeout)
        if req.protocol == "grpc_unary":
            return _grpc_unary(urls.grpc, req, timeout)
        return _http(urls.http, req, timeout, stream=req.protocol == "http_generate_stream")
    except Exception as exc:     # the client library itself refused or the connection broke
        msg = f"{type(exc).__name__}: {exc}"
        return Outcome("transport", msg)


def server_ready(urls: Urls) -> bool:
    try:
        with urllib.request.urlopen(f"{urls.http}/v2/health/ready", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def send_all(urls: Urls, reqs: list[FuzzRequest], timeout: float = 120.0) -> list[Outcome]:
    """The requests at once, one thread each (a burst); outcomes in request order."""
    if len(reqs) == 1:
        return [send(urls, reqs[0], timeout)]
    out: list[Outcome | None] = [None] * len(reqs)

    def run(i: int) -> None:
        out[i] = send(urls, reqs[i], timeout)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return [o or Outcome("timeout", "the sending thread did not return") for o in out]


# -- the pool after a run ---------------------------------------------------------------------------------
def pool_state(metrics_url: str) -> dict[str, float]:
    from kvshare_client.metrics import fetch_metrics, metric_total, parse_samples

    samples = parse_samples(fetch_metrics(metrics_url))
    names = ("kvshare_kv_pages_total", "kvshare_kv_pages_free", "kvshare_kv_pages_active", "kvshare_kv_pages_cached",
             "kvshare_requests_running", "kvshare_requests_waiting")
    return {n: metric_total(samples, n) for n in names}


def pool_leaks(metrics_url: str, timeout_s: float = 60.0) -> list[str]:
    """What is wrong with the idle pool (empty: nothing): referenced pages, or free + cached != total."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = pool_state(metrics_url)
        busy = g["kvshare_kv_pages_active"] or g["kvshare_requests_running"] or g["kvshare_requests_waiting"]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    problems = []
    if g["kvshare_kv_pages_active"]:
        problems.append(f"{g['kvshare_kv_pages_active']:.0f} pages still referenced")
    if g["kvshare_requests_running"] or g["kvshare_requests_waiting"]:
        problems.append(f"requests still in the engine: {g}")
    if g["kvshare_kv_pages_free"] + g["kvshare_kv_pages_cached"] != g["kvshare_kv_pages_total"]:
        problems.append(f"free + cached != total: {g}")
    return problems


# -- the long run -----------------------------------------------------------------------------------------
@dataclass
class Tally:
    by_target: Counter = field(default_factory=Counter)      # (model, protocol) -> requests
    by_kind: Counter = field(default_factory=Counter)        # outcome kind -> requests
    errors: Counter = field(default_factory=Counter)         # (kind, first words of the message) -> requests
    failures: list[tuple[FuzzRequest, Outcome]] = field(default_factory=list)
    not_ready: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, req: FuzzRequest, out: Outcome) -> None:
        with self.lock:
            self.by_target[(req.model, req.protocol)] += 1
            self.by_kind[out.kind] += 1
            if out.kind != "ok":
                self.errors[(out.kind, _error_class(out.detail))] += 1
            if out.kind not in GOOD and len(self.failures) < 50:
                self.failures.append((req, out))

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


def _error_class(message: str) -> str:
    """An error message without its numbers and quoted values, so that like errors count together."""
    import re
    text = re.sub(r"\[request id: [^\]]*\] ", "", message)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"-?\d[\d.e+-]*", "N", text)
    return text[:110]


def summary(tally: Tally, leaks: list[str], seconds: float) -> str:
    lines = [f"wire fuzz: {tally.total} requests in {seconds / 60:.1f} min; server not ready {tally.not_ready} times"]
    lines.append("requests by model and protocol:")
    for model in MODELS:
        row = "  ".join(f"{p} {tally.by_target[(model, p)]}" for p in PROTOCOLS)
        lines.append(f"  {model:<14} {row}")
    lines.append("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.by_kind.items())))
    lines.append("errors by kind (most common first):")
    for (kind, text), n in tally.errors.most_common(40):
        lines.append(f"  {n:6d}  {kind:<14} {text}")
    lines.append("leaks: " + ("none (0 pages active, free + cached = total)" if not leaks else "; ".join(leaks)))
    if tally.failures:
        lines.append(f"failures ({len(tally.failures)} kept):")
        for req, out in tally.failures[:20]:
            lines.append(f"  {out.kind}: {out.detail[:200]}\n      {req.describe()[:400]}")
    return "\n".join(lines)


def _own_server(log_dir: str):
    import os
    import socket
    import tempfile
    from pathlib import Path

    from kvshare import launch

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    root = Path(__file__).resolve().parents[2]
    addr = launch.ServerAddress("127.0.0.1", free_port(), free_port(), free_port())
    log_path = Path(log_dir or tempfile.mkdtemp(prefix="kvshare-fuzz-")) / "tritonserver.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {"KVSHARE_DEBUG_CHECKS": os.environ.get("KVSHARE_DEBUG_CHECKS", "true")}
    print(f"starting a server on {root / 'model_repository'} (log {log_path})", flush=True)
    proc = launch.start(root / "model_repository", addr, log_path=log_path, extra_env=env)
    launch.wait_ready(proc, addr, timeout_s=900)
    return proc, Urls(addr.grpc_url, addr.http_url, addr.metrics_url)


def run(urls: Urls, *, minutes: float, seed: int, burst: int, timeout: float, tally: Tally) -> None:
    """Draws bursts of requests from the strategies until the time is up (no shrinking: every
    failure is kept as it was sent)."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, given, settings

    stop_at = time.monotonic() + minutes * 60
    last_print = [time.monotonic()]
    started = time.monotonic()

    class TimeUp(Exception):
        pass

    @settings(max_examples=10 ** 9, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @hypothesis.seed(seed)
    @given(st.lists(fuzz_requests(), min_size=1, max_size=burst))
    def one_burst(reqs):
        if time.monotonic() > stop_at:
            raise TimeUp
        for req, out in zip(reqs, send_all(urls, reqs, timeout)):
            tally.add(req, out)
        if not server_ready(urls):
            tally.not_ready += 1
        if time.monotonic() - last_print[0] > 10:
            last_print[0] = time.monotonic()
            bad = sum(v for k, v in tally.by_kind.items() if k not in GOOD)
            print(f"[{(time.monotonic() - started) / 60:5.1f} min] {tally.total} requests, "
                  + ", ".join(f"{k} {v}" for k, v in sorted(tally.by_kind.items())) + f"; failures {bad}", flush=True)

    try:
        one_burst()
    except TimeUp:
        pass
    except Exception as exc:     # hypothesis wraps TimeUp when several examples raised it
        if "TimeUp" not in repr(exc):
            raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--grpc-url", help="host:port of a running server (default: start one on free ports)")
    ap.add_argument("--http-url", help="http://host:port (default: the gRPC host, port 8000)")
    ap.add_argument("--metrics-url", help="http://host:port/metrics (default: the gRPC host, port 8002)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--burst", type=int, default=4, help="up to this many requests at once")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds a request may take to end")
    ap.add_argument("--log-dir", default="", help="where the started server writes its log")
    args = ap.parse_args(argv)
    proc = None
    if args.grpc_url:
        host = args.grpc_url.rsplit(":", 1)[0]
        urls = Urls(args.grpc_url, args.http_url or f"http://{host}:8000", args.metrics_url or f"http://{host}:8002/metrics")
    else:
        proc, urls = _own_server(args.log_dir)
    tally = Tally()
    start = time.monotonic()
    try:
        run(urls, minutes=args.minutes, seed=args.seed, burst=args.burst, timeout=args.timeout, tally=tally)
        leaks = pool_leaks(urls.metrics) if server_ready(urls) else ["the server is not ready"]
        print(summary(tally, leaks, time.monotonic() - start), flush=True)
    finally:
        if proc is not None:
            from kvshare import launch
            launch.stop(proc)
    return 0 if not leaks and not tally.failures and not tally.not_ready else 1


if __name__ == "__main__":
    sys.exit(main())
