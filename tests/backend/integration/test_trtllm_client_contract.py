"""TensorRT-LLM's `end_to_end_grpc_client.py` against the real server, request for request.

`e2e()` below sends exactly the tensors that client builds (names, numpy dtypes, [1,1] / [1,N] shapes,
`--batch-inputs` concatenated along axis 0, `exclude_input_in_output` and `temperature` always sent)
over the same transport (`start_stream(callback)` + `async_stream_infer(model, inputs,
outputs=requested_outputs, request_id="")`, no empty final response, `stop_stream()` waits for the
server to close) and reads the answers exactly as it does: `text_output` with `output[0].decode()`,
`batch_index`, `sequence_index` and every perf output with `[0][0]`. Each test names the client flags
it reproduces. Both `ensemble` and `llm_bls` (kvshare's `tensorrt_llm_bls`) are checked.
"""
from __future__ import annotations

import math
import queue
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from kvshare_client import GenerationRequest, KvshareClient

from server_helpers import wait_for_idle_pool

pytestmark = pytest.mark.server

MODELS = ["ensemble", "llm_bls"]
PERF_OUTPUTS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
                "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
PROMPT = "The capital of France is"
# More than two 16-token pages, so that a repeated prompt or a forked sequence can reuse full pages.
LONG_PROMPT = ("Here is a short story about a lighthouse keeper who lived alone on a rocky island far out "
               "in the northern sea, and who kept a diary of every ship that passed. One stormy night")
OUT_LEN = 16


# --- the client, tensor for tensor -------------------------------------------------------------------

def prepare_inputs(prompt, output_len, *, temperature=1.0, streaming=False, beam_width=1, num_return_sequences=None,
                   stop_words=(), bad_words=(), repetition_penalty=None, presence_penalty=None,
                   frequency_penalty=None, embedding_bias_words=None, embedding_bias_weights=None,
                   return_log_probs=False, return_perf_metrics=False, end_id=None, pad_id=None,
                   exclude_input_in_output=False) -> dict[str, np.ndarray]:
    """end_to_end_grpc_client.prepare_inputs with main()'s flag handling (store_true flags become
    [[True]] bool tensors or are absent; exclude_input_in_output is always sent)."""
    input0 = [[prompt]]
    inputs = {
        "text_input": np.array(input0).astype(object),
        "max_tokens": np.ones_like(input0).astype(np.int32) * output_len,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[beam_width]], dtype=np.int32),
        "temperature": np.array([[temperature]], dtype=np.float32),
    }
    if num_return_sequences is not None:
        inputs["num_return_sequences"] = np.array([[num_return_sequences]], dtype=np.int32)
    if bad_words:
        inputs["bad_words"] = np.array([list(bad_words)], dtype=object)
    if stop_words:
        inputs["stop_words"] = np.array([list(stop_words)], dtype=object)
    for name, value in (("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty)):
        if value is not None:
            inputs[name] = np.array([[value]], dtype=np.float32)
    if return_log_probs:
        inputs["return_log_probs"] = np.array([[True]], dtype=bool)
    if embedding_bias_words is not None or embedding_bias_weights is not None:
        assert len(embedding_bias_words) == len(embedding_bias_weights)
        inputs["embedding_bias_words"] = np.array([list(embedding_bias_words)], dtype=object)
        # The CLI hands the weights over as strings (nargs '+'); numpy parses them.
        inputs["embedding_bias_weights"] = np.array([list(embedding_bias_weights)], dtype=np.float32)
    if end_id is not None:
        inputs["end_id"] = np.array([[end_id]], dtype=np.int32)
    if pad_id is not None:
        inputs["pad_id"] = np.array([[pad_id]], dtype=np.int32)
    inputs["exclude_input_in_output"] = np.array([[exclude_input_in_output]], dtype=bool)
    if return_perf_metrics:
        inputs["return_perf_metrics"] = np.array([[True]], dtype=bool)
    return inputs


def prepare_tensor(name: str, value: np.ndarray) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
    t.set_data_from_numpy(value)
    return t


@dataclass
class Response:
    """One response as the client reads it (plus the raw arrays, for the tests' own checks)."""
    batch_index: int
    seq_index: int
    text_output: np.ndarray
    perf: dict[str, float]
    cum_log_probs: np.ndarray | None
    output_log_probs: np.ndarray | None


@dataclass
class Run:
    texts: list[list[str]]                       # [prompt][generation], as the client's batch_output_text
    responses: list[list[Response]] = field(default_factory=list)   # per stream (request)
    errors: list[str] = field(default_factory=list)

    @property
    def all_responses(self) -> list[Response]:
        return [r for stream in self.responses for r in stream]


def e2e(url: str, model_name: str, prompt: str | list[str], *, output_len: int = OUT_LEN, batch_inputs: bool = False,
        **flags) -> Run:
    """end_to_end_grpc_client.run_inference: one stream per request (per prompt, or one for the batch)."""
    prompts = prompt if isinstance(prompt, list) else [prompt]
    streaming = flags.get("streaming", False)
    beam_width = flags.get("beam_width", 1)
    n = flags.get("num_return_sequences")
    bs1 = [prepare_inputs(p, output_len, **flags) for p in prompts]
    if batch_inputs:
        requests = [[prepare_tensor(k, np.concatenate([d[k] for d in bs1], axis=0)) for k in bs1[0]]]
    else:
        requests = [[prepare_tensor(k, v) for k, v in d.items()] for d in bs1]

    outputs = [grpcclient.InferRequestedOutput("text_output")]
    if flags.get("return_log_probs"):
        outputs += [grpcclient.InferRequestedOutput("cum_log_probs"), grpcclient.InferRequestedOutput("output_log_probs")]
    if n is not None and n > 1:
        outputs.append(grpcclient.InferRequestedOutput("sequence_index"))
    if batch_inputs:
        outputs.append(grpcclient.InferRequestedOutput("batch_index"))
    if flags.get("return_perf_metrics"):
        outputs += [grpcclient.InferRequestedOutput(name) for name in PERF_OUTPUTS]

    run = Run(texts=[])
    client = grpcclient.InferenceServerClient(url=url)
    try:
        for inputs in requests:
            completed: queue.Queue = queue.Queue()
            client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), completed))
            batch_size = inputs[0].shape()[0]
            client.async_stream_infer(model_name, inputs, outputs=outputs, request_id="")
            client.stop_stream()   # waits until the server closes the stream

            num_generations = beam_width if n is None else n
            texts = [[""] * num_generations for _ in range(batch_size)]
            got = []
            while True:
                try:
                    result = completed.get(block=False)
                except queue.Empty:
                    break
                if isinstance(result, InferenceServerException):
                    run.errors.append(str(result))
                    continue
                output = result.as_numpy("text_output")
                batch_index = result.as_numpy("batch_index")
                batch_index = 0 if batch_index is None else batch_index[0][0]
                seq_index = result.as_numpy("sequence_index")
                seq_index = 0 if seq_index is None else seq_index[0][0]
                if streaming and beam_width == 1:
                    texts[batch_index][seq_index] += output[0].decode("utf-8")
                else:
                    texts[batch_index][seq_index] = output[0].decode("utf-8")
                perf = {}
                if flags.get("return_perf_metrics"):
                    perf = {name: result.as_numpy(name)[0][0] for name in PERF_OUTPUTS}
                got.append(Response(int(batch_index), int(seq_index), output, perf,
                                    result.as_numpy("cum_log_probs"), result.as_numpy("output_log_probs")))
            run.texts.extend(texts)
            run.responses.append(got)
    finally:
        client.close()
    return run


def ok(run: Run) -> Run:
    assert not run.errors, f"the server answered with errors: {run.errors}"
    return run


# --- fixtures ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url(triton_server):
    return triton_server.grpc_url


@pytest.fixture(scope="module")
def kv(triton_server):
    with KvshareClient(triton_server.grpc_url, stream_timeout=300) as c:
        yield c


@pytest.fixture(autouse=True, scope="module")
def _pool_idle_after(triton_server):
    yield
    wait_for_idle_pool(triton_server.metrics_url)


def greedy_ids(kv, prompt: str, n: int = OUT_LEN) -> list[int]:
    """The greedy token ids of a prompt (kvshare's own client, for the tests that need ids)."""
    return list(kv.generate(GenerationRequest(prompt=prompt, max_tokens=n, temperature=0.0, stream=False)).token_ids)


# --- streaming and not, exclude_input_in_output ------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_greedy_text_equal_streaming_or_not_and_prompt_echoed_only_when_not_streaming(url, model):
    # -p PROMPT --temperature 0 [-S] [--exclude-input-in-output]
    plain = ok(e2e(url, model, PROMPT, temperature=0.0))
    excluded = ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True))
    streamed = ok(e2e(url, model, PROMPT, temperature=0.0, streaming=True))
    streamed_excluded = ok(e2e(url, model, PROMPT, temperature=0.0, streaming=True, exclude_input_in_output=True))
    new = excluded.texts[0][0]
    assert new.strip(), "no text generated"
    assert not new.startswith(PROMPT)
    # The client sends exclude_input_in_output=False unless --exclude-input-in-output: non-streaming
    # output is then the prompt followed by the new text (the client's --check-outputs expects prompt + expected).
    assert plain.texts[0][0] == PROMPT + new
    # Streaming never echoes the prompt: the deltas join to the same new text.
    assert streamed.texts[0][0] == new
    assert streamed_excluded.texts[0][0] == new
    assert len(streamed.all_responses) > 1, "-S must stream several responses"
    assert len(plain.all_responses) == 1 and len(excluded.all_responses) == 1
    for r in streamed.all_responses + plain.all_responses:
        assert r.text_output.ndim == 1 and r.text_output.shape == (1,), "text_output must be rank 1 (output[0] is bytes)"


# --- -n 2 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
def test_num_return_sequences_2(url, model, streaming):
    # -p LONG_PROMPT -n 2 [-S] --exclude-input-in-output --return-perf-metrics   (temperature 1.0: sampled)
    run = ok(e2e(url, model, LONG_PROMPT, num_return_sequences=2, streaming=streaming, exclude_input_in_output=True,
                 return_perf_metrics=True))
    assert {r.seq_index for r in run.all_responses} == {0, 1}
    assert len(run.texts) == 1 and len(run.texts[0]) == 2
    assert all(t.strip() for t in run.texts[0]), run.texts
    if not streaming:
        assert len(run.all_responses) == 2, "one response per sequence"
    # The two sequences share one prefill: the forked one reuses the prompt's full pages.
    last = {r.seq_index: r.perf for r in run.all_responses}
    assert max(p["kv_cache_reused_blocks"] for p in last.values()) > 0, last


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("size", ["short", "long"])
def test_num_return_sequences_2_greedy_both_equal_the_single_greedy_text(url, model, size):
    # -p P --temperature 0 --exclude-input-in-output, then the same with -n 2 [-S], then the first again.
    # The prompt is cached by the first request (short: a partial page; long: two full pages and one
    # partial): the forks must share its pages without writing into them.
    prompt = (f"The capital city of Italy ({model}) is" if size == "short"
              else f"Forks over cached pages ({model}). {LONG_PROMPT}")
    single = ok(e2e(url, model, prompt, temperature=0.0, exclude_input_in_output=True)).texts[0][0]
    whole = ok(e2e(url, model, prompt, temperature=0.0, num_return_sequences=2, exclude_input_in_output=True))
    streamed = ok(e2e(url, model, prompt, temperature=0.0, num_return_sequences=2, streaming=True,
                      exclude_input_in_output=True))
    after = ok(e2e(url, model, prompt, temperature=0.0, exclude_input_in_output=True)).texts[0][0]
    assert whole.texts[0] == [single, single]
    assert streamed.texts[0] == [single, single]
    assert after == single, "the prefix cache must still hold the prompt's KV unchanged"


# --- -b 2 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_beam_width_2(url, model):
    # -p PROMPT -b 2 [-S] [--exclude-input-in-output] --return-log-probs  (temperature 1.0 is always sent)
    whole = ok(e2e(url, model, PROMPT, beam_width=2, exclude_input_in_output=True, return_log_probs=True))
    again = ok(e2e(url, model, PROMPT, beam_width=2, exclude_input_in_output=True, return_log_probs=True))
    streamed = ok(e2e(url, model, PROMPT, beam_width=2, streaming=True))
    echoed = ok(e2e(url, model, PROMPT, beam_width=2))
    [resp] = whole.all_responses
    beams = [b.decode() for b in resp.text_output]
    assert len(beams) == 2 and all(b.strip() for b in beams), beams
    assert beams[0] != beams[1], "two beams of a beam search are different sequences"
    assert whole.texts[0] == [beams[0], ""], "the client stores output[0] under sequence 0"
    assert again.texts == whole.texts, "beam search is deterministic"
    assert resp.cum_log_probs.shape == (1, 2)
    assert resp.output_log_probs.shape[:2] == (1, 2)
    assert np.all(resp.cum_log_probs <= 0)
    # Streaming with beams: the client overwrites with output[0]; the beams come at the end.
    assert streamed.texts[0][0] == beams[0]
    assert echoed.texts[0][0] == PROMPT + beams[0]


# --- --return-log-probs ------------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_return_log_probs(url, model, tokenizer):
    # -p PROMPT --temperature 0 --return-log-probs --exclude-input-in-output [-S]
    whole = ok(e2e(url, model, PROMPT, temperature=0.0, return_log_probs=True, exclude_input_in_output=True))
    [r] = whole.all_responses
    assert r.cum_log_probs.shape == (1, 1)
    lp = r.output_log_probs
    assert lp.ndim == 3 and lp.shape[:2] == (1, 1)
    assert lp.shape[2] == OUT_LEN or whole.texts[0][0] == "", lp.shape   # greedy of a short prompt: no EOS in 16
    assert np.all(lp <= 0) and np.all(np.isfinite(lp))
    assert math.isclose(float(r.cum_log_probs[0][0]), float(lp.sum()), rel_tol=1e-4, abs_tol=1e-3)

    streamed = ok(e2e(url, model, PROMPT, temperature=0.0, return_log_probs=True, streaming=True,
                      exclude_input_in_output=True))
    assert streamed.texts[0][0] == whole.texts[0][0]
    per_token = np.concatenate([s.output_log_probs.reshape(-1) for s in streamed.all_responses])
    np.testing.assert_allclose(per_token, lp.reshape(-1), rtol=1e-4, atol=1e-4)
    # cum_log_probs is cumulative: the last streamed response's equals the whole sum.
    assert math.isclose(float(streamed.all_responses[-1].cum_log_probs[0][0]), float(lp.sum()),
                        rel_tol=1e-4, abs_tol=1e-3)


# --- --return-perf-metrics ---------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
def test_return_perf_metrics(url, model, streaming):
    # -p LONG_PROMPT --return-perf-metrics [-S], twice: the second request reuses the prompt's pages
    # Its own first words: no earlier request of the session shares a page with it.
    prompt = f"Perf metrics of {model}, {'streaming' if streaming else 'whole'}: {LONG_PROMPT}"
    first = ok(e2e(url, model, prompt, temperature=0.0, streaming=streaming, return_perf_metrics=True))
    second = ok(e2e(url, model, prompt, temperature=0.0, streaming=streaming, return_perf_metrics=True))
    for run in (first, second):
        for r in run.all_responses:
            p = r.perf
            assert p["arrival_time_ns"] <= p["first_scheduled_time_ns"] <= p["first_token_time_ns"] \
                <= p["last_token_time_ns"], p
            assert p["arrival_time_ns"] > 0
            assert p["kv_cache_alloc_total_blocks"] >= p["kv_cache_alloc_new_blocks"] >= 0
            assert p["kv_cache_alloc_total_blocks"] >= p["kv_cache_reused_blocks"] >= 0
            assert p["acceptance_rate"] == 0 and p["total_accepted_draft_tokens"] == 0 and p["total_draft_tokens"] == 0
        last = run.all_responses[-1].perf
        assert last["kv_cache_alloc_total_blocks"] >= 2, last   # > 32 prompt tokens + 16 new, 16-token pages
    assert first.all_responses[0].perf["kv_cache_reused_blocks"] == 0, "a new prompt reuses nothing"
    assert second.all_responses[-1].perf["kv_cache_reused_blocks"] >= 2, second.all_responses[-1].perf
    assert second.texts == first.texts
    if streaming:
        times = [r.perf["last_token_time_ns"] for r in first.all_responses]
        assert times == sorted(times)
        assert len({r.perf["first_token_time_ns"] for r in first.all_responses}) == 1


# --- --batch-inputs ----------------------------------------------------------------------------------

BATCH = ["The capital of France is", "The three primary colors are"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
def test_batch_inputs_two_prompts(url, model, streaming):
    # -p '["...", "..."]' --batch-inputs --temperature 0 [-S]  vs. the same prompts one request each
    batched = ok(e2e(url, model, BATCH, batch_inputs=True, temperature=0.0, streaming=streaming))
    single = ok(e2e(url, model, BATCH, temperature=0.0, streaming=streaming))
    assert len(batched.responses) == 1, "--batch-inputs is one request"
    assert {r.batch_index for r in batched.all_responses} == {0, 1}
    assert batched.texts == single.texts
    for prompt, [text] in zip(BATCH, batched.texts):
        assert text.strip()
        assert text.startswith(prompt) != streaming, "non-streaming echoes each row's prompt (exclude=False)"


# --- --stop-words, --bad-words -----------------------------------------------------------------------

def _pick_word(text: str) -> str:
    """A word of the text, with its leading space, from its second half, not occurring earlier."""
    words = text.split()
    for w in words[len(words) // 2:] + words[1:len(words) // 2]:
        if w.isalpha() and " " + w in text:
            return " " + w
    raise AssertionError(f"no usable word in {text!r}")


@pytest.mark.parametrize("model", MODELS)
def test_stop_words_end_the_text_and_are_not_in_it(url, model):
    # -p PROMPT --temperature 0 --exclude-input-in-output [-S] --stop-words WORD
    base = ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True, output_len=24)).texts[0][0]
    stop = _pick_word(base)
    expected = base[:base.index(stop)]
    for streaming in (False, True):
        got = ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True, output_len=24,
                     streaming=streaming, stop_words=[stop, "zebra crossing"])).texts[0][0]
        assert stop not in got
        assert got == expected, (streaming, stop, base)


@pytest.mark.parametrize("model", MODELS)
def test_bad_words_never_appear(url, model, tokenizer):
    # -p PROMPT --temperature 0 --exclude-input-in-output [-S] --bad-words WORD1 WORD2
    base = ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True, output_len=24)).texts[0][0]
    words = [w for w in dict.fromkeys(" " + w for w in base.split() if w.isalpha()) if w in base][:2]
    assert words, base
    for streaming in (False, True):
        got = ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True, output_len=24,
                     streaming=streaming, bad_words=words)).texts[0][0]
        assert got.strip()
        for w in words:
            assert w not in got, (w, got)
        assert got != base


# --- --end-id, --pad-id ------------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_end_id_ends_generation_and_pad_id_is_accepted(url, model, kv, tokenizer):
    # -p PROMPT --temperature 0 --exclude-input-in-output --end-id ID [--pad-id ID] [-S]
    ids = greedy_ids(kv, PROMPT)
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    expected = tokenizer.decode(ids[:k], skip_special_tokens=True)
    for streaming in (False, True):
        got = ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True, streaming=streaming,
                     end_id=ids[k], pad_id=ids[k])).texts[0][0]
        assert got == expected, (streaming, ids, k)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True,
                  end_id=-1, pad_id=2)).texts[0][0] == full
    eos = tokenizer.eos_token_id
    assert ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True,
                  end_id=eos, pad_id=eos)).texts[0][0] == full


# --- --embedding-bias-words / --embedding-bias-weights -----------------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_embedding_bias(url, model):
    # -p PROMPT --temperature 0 --exclude-input-in-output --embedding-bias-words W --embedding-bias-weights X
    base = ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True)).texts[0][0]
    first = " " + base.split()[0]
    down = ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True,
                  embedding_bias_words=[first], embedding_bias_weights=["-100"])).texts[0][0]
    assert not down.startswith(first), (first, down)
    up = ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True, streaming=True,
                embedding_bias_words=[" banana", " zebra"], embedding_bias_weights=["40", "0"])).texts[0][0]
    assert "banana" in up, up
    neutral = ok(e2e(url, model, PROMPT, temperature=0.0, exclude_input_in_output=True,
                     embedding_bias_words=[" banana"], embedding_bias_weights=["0.0"])).texts[0][0]
    assert neutral == base
