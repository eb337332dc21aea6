"""vllm_model's pure parts: a vLLM-backend request -> llm_engine tensors, llm_engine responses -> vLLM
responses; and its serving loop over a fake triton_python_backend_utils (no server)."""
from __future__ import annotations

import json
import sys
import threading
import types

import numpy as np
import pytest

from kvshare.engine.outputs import InvalidRequest


# -- a fake triton_python_backend_utils -----------------------------------------------------------------
class FakeTensor:
    def __init__(self, name, arr):
        self._name, self._arr = name, np.asarray(arr)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._arr


class FakeError:
    INVALID_ARG, INTERNAL, CANCELLED, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "CANCELLED", "UNAVAILABLE"

    def __init__(self, message, code="UNKNOWN"):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class FakeResponse:
    def __init__(self, output_tensors=(), error=None):
        self._tensors, self._error = list(output_tensors), error

    def output_tensors(self):
        return self._tensors

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error

    def arrays(self):
        return {t.name(): t.as_numpy() for t in self._tensors}


class FakeBLS:
    """InferenceRequest: generation requests replay `script` (a callable taking the request and returning an
    iterable of FakeResponse); control requests (cancel_request_key) are recorded."""
    script = None
    cancels: list = []
    generations: list = []

    def __init__(self, model_name, inputs, requested_output_names):
        self.model_name = model_name
        self.inputs = {t.name(): t.as_numpy() for t in inputs}
        self.requested = list(requested_output_names)

    def exec(self, decoupled=False):
        assert decoupled
        if "cancel_request_key" in self.inputs:
            FakeBLS.cancels.append(self.inputs["cancel_request_key"][0, 0].decode())
            return iter([FakeResponse()])
        FakeBLS.generations.append(self)
        return iter(FakeBLS.script(self))


@pytest.fixture
def vm(monkeypatch):
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Tensor, pb.TritonError, pb.InferenceResponse, pb.InferenceRequest = FakeTensor, FakeError, FakeResponse, FakeBLS
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.get_input_tensor_by_name = lambda request, name: request.tensors.get(name)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    monkeypatch.delitem(sys.modules, "kvshare.triton_adapter.vllm_text_model", raising=False)
    import kvshare.triton_adapter.vllm_text_model as module
    FakeBLS.cancels, FakeBLS.generations, FakeBLS.script = [], [], None
    yield module
    sys.modules.pop("kvshare.triton_adapter.vllm_text_model", None)


# -- helpers --------------------------------------------------------------------------------------------
def s(v: str) -> np.ndarray:
    return np.array([v.encode()], dtype=np.object_)


def b(v: bool) -> np.ndarray:
    return np.array([v], dtype=bool)


def getter(**inputs):
    return lambda name: inputs.get(name)


def read(vm, tokenizer, parameters=None, **inputs):
    inputs.setdefault("text_input", s("What is Triton Inference Server?"))
    return vm.read_request(getter(**inputs), parameters, tokenize=lambda get: [1, 2, 3], tokenizer=tokenizer,
                           eos_ids=frozenset({2}))


def engine(req) -> dict:
    return dict(req.engine_inputs)


def scalar(arr):
    return arr.reshape(-1)[0]


def refused(vm, tokenizer, field, parameters=None, **inputs) -> str:
    with pytest.raises(InvalidRequest) as exc:
        read(vm, tokenizer, parameters, **inputs)
    assert str(exc.value).startswith(field + ":"), str(exc.value)
    return str(exc.value)


# -- request -> llm_engine ------------------------------------------------------------------------------
SAMPLE_CLIENT = json.dumps({"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"})


def test_sample_client_request_maps_onto_llm_engine_tensors(vm, tokenizer):
    req = read(vm, tokenizer, SAMPLE_CLIENT, sampling_parameters=s(SAMPLE_CLIENT), stream=b(False),
               exclude_input_in_output=b(False))
    e = engine(req)
    assert req.prompt == "What is Triton Inference Server?" and req.prompt_ids == (1, 2, 3)
    assert req.prepend_input and not req.stream and req.n == 1
    assert scalar(e["temperature"]) == pytest.approx(0.1) and scalar(e["top_p"]) == pytest.approx(0.95)
    assert scalar(e["max_tokens"]) == 100 and e["max_tokens"].dtype == np.int32 and e["max_tokens"].shape == (1, 1)
    # the adapter echoes the prompt text itself: llm_engine never does
    assert scalar(e["exclude_input_in_output"]) and not scalar(e["stream"])
    assert "num_return_sequences" not in e and "return_log_probs" not in e and "end_id" not in e
    assert req.engine_outputs() == ["text_output", "output_ids", "finish_reason"]


def test_defaults_follow_the_vllm_backend(vm, tokenizer):
    req = read(vm, tokenizer)                                   # no sampling_parameters, no parameters
    assert req.prepend_input and not req.stream                 # non-streaming echoes by default
    assert "max_tokens" not in engine(req)                      # the server's default_max_tokens
    assert req.field_prefix == "parameters."
    streamed = read(vm, tokenizer, stream=b(True))
    assert streamed.stream and not streamed.prepend_input       # streaming: no echo by default
    assert not read(vm, tokenizer, exclude_input_in_output=b(True)).prepend_input


def test_streaming_with_the_prompt_echoed_is_refused_as_vllm_does(vm, tokenizer):
    msg = refused(vm, tokenizer, "exclude_input_in_output", stream=b(True), exclude_input_in_output=b(False))
    assert "When streaming, `exclude_input_in_output` = False is not allowed." in msg


def test_generate_endpoint_parameters_are_the_fallback(vm, tokenizer):
    # curl .../generate -d '{"text_input": ..., "parameters": {"stream": false, "temperature": 0}}':
    # stream is an input (a tensor), temperature a request parameter
    req = read(vm, tokenizer, json.dumps({"temperature": 0}), stream=b(False))
    assert scalar(engine(req)["temperature"]) == 0.0 and req.prepend_input
    # a gRPC client may send the model's own inputs as parameters; a tensor wins over them
    req = read(vm, tokenizer, json.dumps({"stream": True, "exclude_input_in_output": True, "max_tokens": "5",
                                          "triton_enable_empty_final_response": True, "id": "7"}))
    assert req.stream and not req.prepend_input and scalar(engine(req)["max_tokens"]) == 5
    req = read(vm, tokenizer, json.dumps({"stream": True, "exclude_input_in_output": True}), stream=b(False))
    assert not req.stream
    # with a sampling_parameters tensor, the parameters are not read
    req = read(vm, tokenizer, json.dumps({"bogus": 1}), sampling_parameters=s(json.dumps({"max_tokens": 3})))
    assert scalar(engine(req)["max_tokens"]) == 3 and req.field_prefix == "sampling_parameters."


def test_unknown_keys_and_bad_values_name_their_field(vm, tokenizer):
    refused(vm, tokenizer, "sampling_parameters.bogus", sampling_parameters=s('{"bogus": 1}'))
    refused(vm, tokenizer, "parameters.bogus", '{"bogus": 1}')
    refused(vm, tokenizer, "sampling_parameters.temperature", sampling_parameters=s('{"temperature": "-1"}'))
    refused(vm, tokenizer, "sampling_parameters", sampling_parameters=s("{not json"))
    refused(vm, tokenizer, "text_input", text_input=s("a").repeat(2))
    refused(vm, tokenizer, "text_input", text_input=np.array([b"caf\xe9 \xff"], dtype=np.object_))
    refused(vm, tokenizer, "image", image=s("aGk="))
    refused(vm, tokenizer, "embedding_request", embedding_request=s("{}"))
    refused(vm, tokenizer, "stream", stream=np.array([b"yes"], dtype=np.object_))


def test_sampling_keys_reach_llm_engine(vm, tokenizer):
    sp = {"n": 3, "seed": 2 ** 63, "stop": "\n\n", "ignore_eos": True, "top_k": -1, "min_tokens": 2,
          "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1}
    req = read(vm, tokenizer, sampling_parameters=s(json.dumps(sp)))
    e = engine(req)
    assert scalar(e["num_return_sequences"]) == 3 and req.n == 3 and "sequence_index" in req.engine_outputs()
    assert e["seed"].dtype == np.uint64 and scalar(e["seed"]) == 2 ** 63
    assert e["stop_words"].tolist() == [[b"\n\n"]] and scalar(e["ignore_eos"])
    assert scalar(e["top_k"]) == 0 and scalar(e["min_tokens"]) == 2
    assert scalar(e["presence_penalty"]) == 0.5 and scalar(e["frequency_penalty"]) == -0.5
    assert scalar(e["repetition_penalty"]) == pytest.approx(1.1)
    e = engine(read(vm, tokenizer, sampling_parameters=s(json.dumps({"stop": ["a", "", "bc"]}))))
    assert e["stop_words"].tolist() == [[b"a", b"bc"]]


def test_stop_token_ids_map_onto_one_end_id_or_are_refused(vm, tokenizer):
    def e(sp):
        return engine(read(vm, tokenizer, sampling_parameters=s(json.dumps(sp))))
    assert "end_id" not in e({"stop_token_ids": [2]})                  # the EOS already ends it
    got = e({"stop_token_ids": [13], "ignore_eos": True})              # EOS ignored, 13 ends it: exact
    assert scalar(got["end_id"]) == 13 and "ignore_eos" not in got
    msg = refused(vm, tokenizer, "sampling_parameters.stop_token_ids", sampling_parameters=s('{"stop_token_ids": [13]}'))
    assert "in addition to EOS" in msg
    refused(vm, tokenizer, "sampling_parameters.stop_token_ids",
            sampling_parameters=s('{"stop_token_ids": [13, 14], "ignore_eos": true}'))


def test_bad_words_are_sent_as_vllm_tokenizes_them(vm, tokenizer):
    e = engine(read(vm, tokenizer, sampling_parameters=s(json.dumps({"bad_words": ["Paris", " world"]}))))
    words = [w.decode() for w in e["bad_words"].reshape(-1)]
    assert words == ["Paris", " Paris", "world", " world"]
    for w in words:                                     # each is a distinct token sequence for llm_engine
        assert tokenizer.encode(w, add_special_tokens=False)


def test_logit_bias_ids_become_words_that_tokenize_back_to_them(vm, tokenizer):
    e = engine(read(vm, tokenizer, sampling_parameters=s(json.dumps({"logit_bias": {"28": -100, "2": 5.5}}))))
    words = [w.decode() for w in e["embedding_bias_words"].reshape(-1)]
    assert words == [",", "<|im_end|>"] and e["embedding_bias_weights"].tolist() == [[-100.0, 5.5]]
    for w, t in zip(words, (28, 2)):
        assert tokenizer.encode(w, add_special_tokens=False) == [t]
    refused(vm, tokenizer, "sampling_parameters.logit_bias", sampling_parameters=s('{"logit_bias": {"999999": 1}}'))


def test_log_probs_are_asked_of_llm_engine_only_when_returned(vm, tokenizer):
    def req(sp, **flags):
        return read(vm, tokenizer, sampling_parameters=s(json.dumps(sp)), **{k: b(v) for k, v in flags.items()})
    assert "return_log_probs" not in engine(req({"logprobs": 1}))
    r = req({"logprobs": 0}, return_logprobs=True)
    assert scalar(engine(r)["return_log_probs"]) and "output_log_probs" in r.engine_outputs()
    assert "return_log_probs" not in engine(req({}, return_logprobs=True))           # "null" without logprobs
    assert scalar(engine(req({}, return_cumulative_logprob=True))["return_log_probs"])


def test_remap_engine_error(vm):
    assert vm.remap_engine_error("max_tokens: prompt (5) + max_tokens (9) exceeds", "sampling_parameters.") == \
        "sampling_parameters.max_tokens: prompt (5) + max_tokens (9) exceeds"
    assert vm.remap_engine_error("input_ids: is empty", "parameters.") == "text_input: is empty"
    assert vm.remap_engine_error("llm_engine is overloaded: 3", "parameters.") == "llm_engine is overloaded: 3"


# -- llm_engine responses -> vLLM responses -------------------------------------------------------------
def engine_arrays(text, ids, reason="", seq=None, cum=None, lps=None):
    """A response as llm_engine's pump builds it (text_output rank 1, [1, 1] scalars, output_log_probs [1, 1, k])."""
    a = {"text_output": np.array([text.encode()], dtype=np.object_),
         "output_ids": np.array(ids, dtype=np.int32).reshape(1, -1),
         "finish_reason": np.array([[reason.encode()]], dtype=np.object_)}
    if seq is not None:
        a["sequence_index"] = np.array([[seq]], dtype=np.int32)
    if cum is not None:
        a["cum_log_probs"] = np.array([[cum]], dtype=np.float32)
        a["output_log_probs"] = np.array(lps, dtype=np.float32).reshape(1, 1, -1)
    return a


def make_request(vm, *, stream, n=1, prepend=False, logprobs=None, returns=()):
    return vm.VLLMRequest(prompt="Hi", prompt_ids=(1, 2, 3), stream=stream, prepend_input=prepend, n=n,
                          logprobs=logprobs, returns=frozenset(returns), engine_inputs=())


ALL_RETURNS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
               "return_num_output_tokens")


def test_engine_response_reads_llm_engine_tensors(vm):
    r = vm.engine_response(engine_arrays(" there", [5, 6], "stop", seq=1, cum=-1.5, lps=[-1.0, -0.5]))
    assert r == vm.EngineResponse(1, " there", (5, 6), "stop", -1.5, (-1.0, -0.5))
    assert vm.engine_response(engine_arrays("", [7])) == vm.EngineResponse(0, "", (7,), "", None, ())


def test_streamed_deltas_with_every_output_and_the_final_flag_on_the_last(vm):
    asm = vm.OutputAssembler(make_request(vm, stream=True, logprobs=0, returns=ALL_RETURNS), lambda t: f"<{t}>")
    first, last = asm.add(vm.engine_response(engine_arrays("Hel", [5, 6], cum=-1.0, lps=[-0.25, -0.75])))
    assert not last
    assert first["text_output"].tolist() == [b"Hel"] and first["finish_reason"].tolist() == [b"None"]
    assert first["num_output_tokens"].tolist() == [2] and first["num_output_tokens"].dtype == np.uint32
    assert first["num_input_tokens"].tolist() == [3] and first["num_input_tokens"].dtype == np.uint32
    assert first["cumulative_logprob"].tolist() == [-1.0] and first["cumulative_logprob"].dtype == np.float32
    assert json.loads(first["logprobs"][0]) == [
        {"5": {"logprob": -0.25, "rank": None, "decoded_token": "<5>"}},
        {"6": {"logprob": -0.75, "rank": None, "decoded_token": "<6>"}}]
    end, last = asm.add(vm.engine_response(engine_arrays("lo", [7], "length", cum=-1.5, lps=[-0.5])))
    assert last and asm.done
    assert end["text_output"].tolist() == [b"lo"] and end["finish_reason"].tolist() == [b"length"]
    assert end["num_output_tokens"].tolist() == [1] and end["cumulative_logprob"].tolist() == [-1.5]
    assert [list(d) for d in json.loads(end["logprobs"][0])] == [["7"]]


def test_only_asked_outputs_and_null_logprobs_without_sampling_logprobs(vm):
    asm = vm.OutputAssembler(make_request(vm, stream=True), str)
    out, last = asm.add(vm.engine_response(engine_arrays("x", [5], "stop")))
    assert set(out) == {"text_output"} and last
    asm = vm.OutputAssembler(make_request(vm, stream=True, returns=("return_logprobs",)), str)
    out, _ = asm.add(vm.engine_response(engine_arrays("x", [5], "stop")))
    assert out["logprobs"].tolist() == [b"null"]


def test_n_streamed_sequences_are_one_element_each(vm):
    asm = vm.OutputAssembler(make_request(vm, stream=True, n=2, returns=("return_finish_reason",
                                                                          "return_num_output_tokens")), str)
    out, last = asm.add(vm.engine_response(engine_arrays("A", [5], seq=1)))
    assert out["text_output"].tolist() == [b"", b"A"] and out["num_output_tokens"].tolist() == [0, 1] and not last
    out, last = asm.add(vm.engine_response(engine_arrays("B", [6], "stop", seq=0)))
    assert out["text_output"].tolist() == [b"B", b""] and out["finish_reason"].tolist() == [b"stop", b"None"]
    assert not last
    out, last = asm.add(vm.engine_response(engine_arrays("C", [7], "length", seq=1)))
    assert out["text_output"].tolist() == [b"", b"C"] and out["finish_reason"].tolist() == [b"stop", b"length"]
    assert last
    with pytest.raises(ValueError):
        asm.add(vm.engine_response(engine_arrays("D", [8], "stop", seq=1)))


def test_non_streamed_n_is_one_response_with_every_text_and_the_prompt_echoed(vm):
    asm = vm.OutputAssembler(make_request(vm, stream=False, n=2, prepend=True,
                                          returns=("return_num_output_tokens", "return_finish_reason")), str)
    assert asm.add(vm.engine_response(engine_arrays(" one two", [5, 6], "length", seq=1))) is None
    out, last = asm.add(vm.engine_response(engine_arrays(" three", [7], "stop", seq=0)))
    assert last and out["text_output"].tolist() == [b"Hi three", b"Hi one two"]
    assert out["num_output_tokens"].tolist() == [1, 2] and out["finish_reason"].tolist() == [b"stop", b"length"]


def test_cancelled_is_vllms_abort(vm):
    asm = vm.OutputAssembler(make_request(vm, stream=True, returns=("return_finish_reason",)), str)
    out, _ = asm.add(vm.engine_response(engine_arrays("", [], "cancelled")))
    assert out["finish_reason"].tolist() == [b"abort"]


# -- the serving loop over the fake stub ----------------------------------------------------------------
class FakeSender:
    def __init__(self, cancelled=False):
        self.sent: list[tuple[FakeResponse | None, int]] = []
        self.cancelled = cancelled
        self.probes_after_final = 0

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        if any(f for _, f in self.sent):
            self.probes_after_final += 1
        return self.cancelled


class FakeRequest:
    def __init__(self, parameters="{}", requested=(), **tensors):
        self.tensors = {k: FakeTensor(k, v) for k, v in tensors.items()}
        self._parameters = parameters
        self._requested = list(requested)
        self.sender = FakeSender()

    def requested_output_names(self):
        return self._requested

    def get_response_sender(self):
        return self.sender

    def parameters(self):
        return self._parameters

    def inputs(self):
        return list(self.tensors.values())

    def request_id(self):
        return "r1"


def serve(model, req):
    """What execute() does for one request, on this thread: the snapshot, then the worker's part."""
    from kvshare.triton_adapter.request_snapshot import snapshot_request

    model._serve(snapshot_request(req))


class FakePrompter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def prompt_ids(self, get):
        return [1, 2, 3]


def make_model(vm, tokenizer, poll_s=0.01):
    model = vm.VLLMTextModel()
    model.prompter = FakePrompter(tokenizer)
    model.eos_ids = frozenset({2})
    model.output_names = {"text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                          "num_output_tokens"}
    model.watch = vm.CancelWatch(poll_s)
    model.engine = vm.EngineLink(vm.pb_utils, "llm_engine", "vllm_model")
    return model


def engine_stream(*arrays, final_flag_only=True):
    responses = [FakeResponse([FakeTensor(k, v) for k, v in a.items()]) for a in arrays]
    return responses + ([FakeResponse()] if final_flag_only else [])


def finals(sender):
    return [r for r, f in sender.sent if f]


def test_serve_streams_and_sets_the_final_flag_on_the_last_data_response(vm, tokenizer):
    model = make_model(vm, tokenizer)
    FakeBLS.script = lambda bls: engine_stream(engine_arrays("Hel", [5]), engine_arrays("lo", [6], "length"))
    req = FakeRequest(text_input=s("Hi"), stream=b(True), sampling_parameters=s('{"max_tokens": "2"}'))
    serve(model, req)
    sent = req.sender.sent
    assert [f for _, f in sent] == [0, 1]
    assert [r.arrays()["text_output"].tolist() for r, _ in sent] == [[b"Hel"], [b"lo"]]
    bls = FakeBLS.generations[0]
    assert bls.inputs["input_ids"].tolist() == [[1, 2, 3]] and scalar(bls.inputs["max_tokens"]) == 2
    assert len(bls.inputs["request_key"][0, 0]) == 32 and not FakeBLS.cancels
    assert len(model.engine.finished) == 1      # kept after its last response (bls_retention.py)
    model.watch.close()


def test_a_response_carries_only_the_outputs_the_client_asked_for(vm, tokenizer):
    """A client that names text_output alone gets text_output alone, even with return_finish_reason
    on: Triton 2.51 would drop the rest inside send() without the GIL (response_stream.only_requested)."""
    model = make_model(vm, tokenizer)
    FakeBLS.script = lambda bls: engine_stream(engine_arrays("Hel", [5]), engine_arrays("lo", [6], "length"))
    req = FakeRequest(text_input=s("Hi"), stream=b(True), return_finish_reason=b(True),
                      requested=["text_output"])
    serve(model, req)
    assert [set(r.arrays()) for r, _ in req.sender.sent] == [{"text_output"}, {"text_output"}]
    req = FakeRequest(text_input=s("Hi"), stream=b(True), return_finish_reason=b(True))
    serve(model, req)
    assert [set(r.arrays()) for r, _ in req.sender.sent] == [{"text_output", "finish_reason"}] * 2
    model.watch.close()


def test_serve_non_streaming_is_one_final_response(vm, tokenizer):
    model = make_model(vm, tokenizer)
    FakeBLS.script = lambda bls: engine_stream(engine_arrays(" world", [5, 6], "stop"))
    req = FakeRequest(json.dumps({"temperature": 0}), text_input=s("Hello"), stream=b(False))
    serve(model, req)
    assert len(req.sender.sent) == 1 and req.sender.sent[0][1] == 1
    assert req.sender.sent[0][0].arrays()["text_output"].tolist() == [b"Hello world"]
    model.watch.close()


def test_serve_refuses_bad_input_without_calling_llm_engine(vm, tokenizer):
    model = make_model(vm, tokenizer)
    req = FakeRequest(text_input=s("Hi"), sampling_parameters=s('{"bogus": 1}'))
    serve(model, req)
    (resp, flags), = req.sender.sent
    assert flags == 1 and resp.error().code() == "INVALID_ARG"
    assert resp.error().message().startswith("sampling_parameters.bogus:")
    assert not FakeBLS.generations
    model.watch.close()


def test_serve_forwards_an_engine_error_once_and_stops_the_other_sequences(vm, tokenizer):
    model = make_model(vm, tokenizer)
    err = FakeError("max_tokens: prompt (3) + max_tokens (9) exceeds the context length 8", "INVALID_ARG")
    FakeBLS.script = lambda bls: [FakeResponse(error=err)]
    req = FakeRequest(text_input=s("Hi"), sampling_parameters=s('{"max_tokens": 9, "n": 2}'))
    serve(model, req)
    (resp, flags), = req.sender.sent
    assert flags == 1 and resp.error().code() == "INVALID_ARG"
    assert resp.error().message().startswith("sampling_parameters.max_tokens: prompt (3)")
    key = scalar(FakeBLS.generations[0].inputs["request_key"]).decode()
    assert FakeBLS.cancels == [key, f"{key}/0.0", f"{key}/0.1"]
    model.watch.close()


def test_serve_ends_with_an_error_when_llm_engine_fails(vm, tokenizer):
    model = make_model(vm, tokenizer)

    def boom(bls):
        yield FakeResponse([FakeTensor(k, v) for k, v in engine_arrays("a", [5]).items()])
        raise RuntimeError("llm_engine is gone")
    FakeBLS.script = boom
    req = FakeRequest(text_input=s("Hi"), stream=b(True))
    serve(model, req)
    assert [f for _, f in req.sender.sent] == [0, 1]
    assert "llm_engine is gone" in finals(req.sender)[0].error().message()
    model.watch.close()


def test_a_cancelled_client_cancels_llm_engine_and_gets_one_cancelled_final(vm, tokenizer):
    model = make_model(vm, tokenizer, poll_s=0.005)
    req = FakeRequest(text_input=s("Hi"), stream=b(True))
    released = threading.Event()

    def slow(bls):
        yield FakeResponse([FakeTensor(k, v) for k, v in engine_arrays("a", [5]).items()])
        req.sender.cancelled = True
        assert released.wait(5)           # llm_engine ends the request once it hears the cancel
        yield FakeResponse([FakeTensor(k, v) for k, v in engine_arrays("", [], "cancelled").items()])
    FakeBLS.script = slow
    real_cancel = model.engine.cancel

    def cancel(keys):
        real_cancel(keys)
        released.set()
    model.engine.cancel = cancel
    serve(model, req)
    assert [f for _, f in req.sender.sent] == [0, 1]
    final = finals(req.sender)[0]
    assert final.error().code() == "CANCELLED" and final.error().message() == "Request was cancelled"
    assert len(FakeBLS.cancels) == 1
    assert len(model.engine.finished) == 2      # the stream and the cancel's, kept (bls_retention.py)
    time_probes = req.sender.probes_after_final
    model.watch.poll_once()
    assert req.sender.probes_after_final == time_probes == 0
    model.watch.close()


def test_cancel_watch_never_probes_a_removed_sender_and_fires_once(vm):
    watch = vm.CancelWatch(poll_s=3600)        # polled by hand
    fired = []
    a, b_ = FakeSender(cancelled=True), FakeSender(cancelled=False)
    ta = watch.add(a, lambda: fired.append("a"))
    tb = watch.add(b_, lambda: fired.append("b"))
    watch.poll_once()
    watch.poll_once()
    assert fired == ["a"]
    watch.remove(tb)
    b_.send(None, 1)                            # its final went out: a probe now would read freed memory
    b_.cancelled = True
    watch.poll_once()
    assert fired == ["a"] and b_.probes_after_final == 0
    watch.remove(ta)
    watch.close()


class FinalFailsOnce(FakeSender):
    """A sender whose first final send raises, as a stub's send does when its IPC fails."""

    def send(self, response=None, flags=0):
        if flags and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("the stub could not send the response")
        super().send(response, flags)


def test_a_final_that_fails_to_send_is_replaced_by_an_internal_error_final(vm, tokenizer):
    model = make_model(vm, tokenizer)
    FakeBLS.script = lambda bls: engine_stream(engine_arrays(" world", [5, 6], "stop"))
    req = FakeRequest(json.dumps({"temperature": 0}), text_input=s("Hello"), stream=b(False))
    req.sender = FinalFailsOnce()
    serve(model, req)
    (resp, flags), = req.sender.sent
    assert flags == 1 and resp.error().code() == "INTERNAL"
    assert "without its final response" in resp.error().message()
    model.watch.close()


def test_an_exception_outside_the_stream_still_ends_the_request(vm, tokenizer, monkeypatch):
    model = make_model(vm, tokenizer)
    monkeypatch.setattr(model, "_read", lambda request: (_ for _ in ()).throw(KeyboardInterrupt()))
    req = FakeRequest(text_input=s("Hi"))
    serve(model, req)
    (resp, flags), = req.sender.sent
    assert flags == 1 and resp.error().code() == "INTERNAL"
    model.watch.close()
