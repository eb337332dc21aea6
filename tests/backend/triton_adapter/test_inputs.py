"""The wire contract's input parsing: defaults, and an error naming the field for every bad value."""
from __future__ import annotations

import numpy as np
import pytest

from kvshare.engine.outputs import InvalidRequest
from kvshare.triton_adapter.inputs import generation_request, text_input


def getter(**values):
    def get(name):
        v = values.get(name)
        if v is None:
            return None
        return v if isinstance(v, np.ndarray) else np.array([[v]])
    return get


def test_defaults_apply_when_inputs_are_absent():
    req = generation_request(getter(input_ids=np.array([[1, 2, 3]], np.int32)), default_max_tokens=77)
    assert req.prompt_ids == [1, 2, 3]
    assert req.params.max_tokens == 77 and req.params.temperature == 1.0 and req.params.top_p == 1.0
    assert not req.stream and req.exclude_input_in_output and req.cache_salt == ""


def test_every_input_is_read():
    req = generation_request(getter(
        input_ids=np.array([[5, 6]], np.int32), max_tokens=np.array([[9]], np.int32), temperature=np.array([[0.5]], np.float32),
        top_p=np.array([[0.9]], np.float32), top_k=np.array([[40]], np.int32), min_tokens=np.array([[2]], np.int32),
        seed=np.array([[2**63 + 5]], np.uint64), repetition_penalty=np.array([[1.1]], np.float32),
        presence_penalty=np.array([[0.5]], np.float32), frequency_penalty=np.array([[-0.5]], np.float32),
        stop_words=np.array([[b"\n\n", "停".encode()]], dtype=object), stream=np.array([[True]]),
        exclude_input_in_output=np.array([[False]]), return_num_input_tokens=np.array([[True]]),
        return_num_output_tokens=np.array([[True]]), cache_salt=np.array([[b"tenant-a"]], dtype=object),
        ignore_eos=np.array([[True]])), default_max_tokens=1)
    p = req.params
    assert (p.max_tokens, p.top_k, p.min_tokens, p.seed) == (9, 40, 2, 2**63 + 5)
    assert p.temperature == 0.5 and abs(p.top_p - 0.9) < 1e-6 and abs(p.repetition_penalty - 1.1) < 1e-6
    assert p.presence_penalty == 0.5 and p.frequency_penalty == -0.5 and p.ignore_eos
    assert p.stop == ("\n\n", "停")
    assert req.stream and not req.exclude_input_in_output and req.return_num_input_tokens and req.return_num_output_tokens
    assert req.cache_salt == "tenant-a"


@pytest.mark.parametrize("field,value", [
    ("max_tokens", np.array([[0]], np.int32)), ("temperature", np.array([[-1.0]], np.float32)),
    ("temperature", np.array([[np.nan]], np.float32)), ("top_p", np.array([[-0.1]], np.float32)),
    ("top_p", np.array([[1.01]], np.float32)), ("top_k", np.array([[-1]], np.int32)),
    ("min_tokens", np.array([[-2]], np.int32)), ("repetition_penalty", np.array([[0.0]], np.float32)),
    ("frequency_penalty", np.array([[3.0]], np.float32)), ("max_tokens", np.array([[1, 2]], np.int32)),
    ("stop_words", np.array([[1.5]], dtype=np.float32)), ("stop_words", np.array([[b"\xff\xfe"]], dtype=object)),
    ("stop_words", np.zeros((2, 2, 1), dtype=object)), ("cache_salt", np.array([[b"\xc3"]], dtype=object)),
    ("input_ids", np.array([[[1, 2]]], np.int32)), ("input_ids", np.zeros((1, 0), np.int32)),
    ("max_tokens", np.array([[1], [2]], np.int32)), ("input_lengths", np.array([[3]], np.int32)),
])
def test_bad_values_name_their_field(field, value):
    values = {"input_ids": np.array([[1, 2]], np.int32), field: value}
    with pytest.raises(InvalidRequest) as err:
        generation_request(getter(**values), default_max_tokens=8)
    assert err.value.field == field and str(err.value).startswith(field)


@pytest.mark.parametrize("raw", [None, b"", b"   ", b"\xff"])
def test_text_input_errors(raw):
    with pytest.raises(InvalidRequest, match="text_input"):
        text_input(getter(text_input=None if raw is None else np.array([[raw]], dtype=object)))


# -- TRT-LLM contract: aliases, refusals, batches, beams -------------------------------------------------
from kvshare.triton_adapter import contract  # noqa: E402
from kvshare.triton_adapter.inputs import generation_requests, text_prompts  # noqa: E402
from kvshare.triton_adapter.text_prompt import PromptLimits, TextPrompter, pad_rows  # noqa: E402

IDS = np.array([[1, 2]], np.int32)


def parse(**values):
    return generation_requests(getter(input_ids=IDS, **values) if "input_ids" not in values else getter(**values),
                               default_max_tokens=8)


def refused(field, **values):
    with pytest.raises(InvalidRequest) as err:
        parse(**values)
    assert err.value.field == field and str(err.value).startswith(field), str(err.value)
    return str(err.value)


@pytest.mark.parametrize("old,new,value,read", [
    ("min_length", "min_tokens", np.array([[3]], np.int32), lambda r: r.params.min_tokens == 3),
    ("random_seed", "seed", np.array([[7]], np.uint64), lambda r: r.params.seed == 7),
    ("runtime_top_k", "top_k", np.array([[5]], np.int32), lambda r: r.params.top_k == 5),
    ("runtime_top_p", "top_p", np.array([[0.5]], np.float32), lambda r: r.params.top_p == 0.5),
    ("len_penalty", "length_penalty", np.array([[0.5]], np.float32), lambda r: r.params.length_penalty == 0.5),
    ("streaming", "stream", np.array([[True]]), lambda r: r.stream),
    ("return_kv_cache_reuse_stats", "return_perf_metrics", np.array([[True]]), lambda r: r.return_perf_metrics),
    ("request_output_len", "max_tokens", np.array([[11]], np.int32), lambda r: r.params.max_tokens == 11),
])
def test_older_names_mean_the_current_input(old, new, value, read):
    assert contract.BY_NAME[old].canonical == new
    assert read(parse(**{old: value})[0]) and read(parse(**{new: value})[0])
    assert "send one of them" in refused(old, **{old: value, new: value})


def test_old_names_are_named_in_errors():
    refused("runtime_top_p", runtime_top_p=np.array([[1.5]], np.float32))
    refused("request_output_len", request_output_len=np.array([[0]], np.int32))


def test_trtllm_inputs_map_onto_sampling_params_and_request_fields():
    r = parse(end_id=np.array([[2]], np.int32), pad_id=np.array([[0]], np.int32),
              return_log_probs=np.array([[True]]), return_generation_logits=np.array([[True]]),
              return_context_logits=np.array([[True]]), num_return_sequences=np.array([[3]], np.int32),
              bad_words=np.array([[b"foo", b"", "bär".encode()]], dtype=object),
              embedding_bias_words=np.array([[b"a", b"b"]], dtype=object),
              embedding_bias_weights=np.array([[0.5, -1.0]], np.float32), length_penalty=np.array([[0.0]], np.float32),
              return_perf_metrics=np.array([[True]]))[0]
    p = r.params
    assert p.end_ids == (2,) and r.pad_id == 0 and p.logprobs == 0 and r.return_log_probs
    assert p.return_generation_logits and r.return_generation_logits and p.return_context_logits and r.return_context_logits
    assert r.num_return_sequences == 3 and r.bad_words == ("foo", "bär") and r.embedding_bias == (("a", 0.5), ("b", -1.0))
    assert p.length_penalty == 0.0 and r.return_perf_metrics and p.beam_width == 1
    d = parse()[0]
    assert d.params.end_ids is None and d.pad_id is None and d.params.logprobs == -1 and d.num_return_sequences == 1
    assert d.exclude_input_in_output and d.batch_index == 0 and d.batch_size == 1
    assert parse(end_id=np.array([[-1]], np.int32))[0].params.end_ids == ()


def test_empty_words_mean_none():
    r = parse(stop_words=np.array([[b""]], dtype=object), bad_words=np.array([[b""]], dtype=object))[0]
    assert r.params.stop == () and r.bad_words == ()
    assert parse(stop_words=np.array([[b"", b"x"]], dtype=object))[0].params.stop == ("x",)


def test_top_p_zero_is_trtllm_off_and_greedy_without_top_k():
    p = parse(top_p=np.array([[0.0]], np.float32))[0].params
    assert (p.top_p, p.top_k) == (1.0, 1)
    p = parse(runtime_top_p=np.array([[0.0]], np.float32), runtime_top_k=np.array([[40]], np.int32))[0].params
    assert (p.top_p, p.top_k) == (1.0, 40)


@pytest.mark.parametrize("field,values", [
    ("beam_width", dict(beam_width=np.array([[0]], np.int32))),
    ("beam_width", dict(beam_width=np.array([[9]], np.int32))),
    ("num_return_sequences", dict(num_return_sequences=np.array([[0]], np.int32))),
    ("num_return_sequences", dict(num_return_sequences=np.array([[9]], np.int32))),
    ("num_return_sequences", dict(beam_width=np.array([[2]], np.int32), num_return_sequences=np.array([[3]], np.int32))),
    ("temperature", dict(beam_width=np.array([[2]], np.int32), temperature=np.array([[0.7]], np.float32))),
    ("top_k", dict(beam_width=np.array([[2]], np.int32), top_k=np.array([[40]], np.int32))),
    ("runtime_top_p", dict(beam_width=np.array([[2]], np.int32), runtime_top_p=np.array([[0.9]], np.float32))),
    ("stop_words", dict(beam_width=np.array([[2]], np.int32), stop_words=np.array([[b"x"]], dtype=object))),
    ("bad_words", dict(beam_width=np.array([[2]], np.int32), bad_words=np.array([[b"x"]], dtype=object))),
    ("repetition_penalty", dict(beam_width=np.array([[2]], np.int32), repetition_penalty=np.array([[1.2]], np.float32))),
    ("min_length", dict(beam_width=np.array([[2]], np.int32), min_length=np.array([[2]], np.int32))),
    ("length_penalty", dict(length_penalty=np.array([[np.inf]], np.float32))),
    ("end_id", dict(end_id=np.array([[-2]], np.int32))),
    ("embedding_bias_words", dict(embedding_bias_words=np.array([[b"a"]], dtype=object))),
    ("embedding_bias_words", dict(embedding_bias_words=np.array([[b"a"]], dtype=object),
                                  embedding_bias_weights=np.array([[1.0, 2.0]], np.float32))),
    ("seed", dict(seed=np.array([[b"7"]], dtype=object))),
])
def test_contract_values_refused_by_name(field, values):
    msg = refused(field, **values)
    if field == "embedding_bias_words":
        assert "embedding_bias_weights" in msg


def test_beam_search_takes_the_end_to_end_clients_temperature_and_streams():
    r = parse(beam_width=np.array([[4]], np.int32), temperature=np.array([[1.0]], np.float32),
              stream=np.array([[True]]), runtime_top_k=np.array([[1]], np.int32),
              runtime_top_p=np.array([[0.0]], np.float32))[0]
    assert r.params.beam_width == 4 and r.num_return_sequences == 4 and r.stream and r.params.temperature == 0.0
    r = parse(beam_width=np.array([[4]], np.int32), num_return_sequences=np.array([[2]], np.int32))[0]
    assert r.num_return_sequences == 2


@pytest.mark.parametrize("name,value", [
    ("lora_task_id", np.array([[0]], np.uint64)), ("lora_weights", np.ones((1, 2, 2), np.float16)),
    ("lora_config", np.ones((1, 1, 3), np.int32)), ("prompt_embedding_table", np.ones((1, 2, 2), np.float16)),
    ("prompt_vocab_size", np.array([[5]], np.int32)), ("prompt_table_extra_id", np.array([[3]], np.uint64)),
    ("guided_decoding_guide_type", np.array([[b"json"]], dtype=object)),
    ("guided_decoding_guide", np.array([[b"{}"]], dtype=object)),
    ("decoder_text_input", np.array([[b"hi"]], dtype=object)), ("image_url_input", np.array([[b"http://x"]], dtype=object)),
    ("image_input", np.ones((1, 1, 3, 2, 2), np.float16)), ("video_bytes_input", np.ones((1, 1, 1, 1, 1), np.uint8)),
    ("num_draft_tokens", np.array([[4]], np.int32)), ("use_draft_logits", np.array([[True]])),
    ("beam_search_diversity_rate", np.array([[0.5]], np.float32)), ("early_stopping", np.array([[True]])),
    ("no_repeat_ngram_size", np.array([[3]], np.int32)), ("runtime_top_p_decay", np.array([[0.9]], np.float32)),
    ("runtime_top_p_min", np.array([[0.1]], np.float32)), ("runtime_top_p_reset_ids", np.array([[5]], np.int32)),
    ("stop", np.array([[True]])), ("draft_input_ids", np.array([[1, 2]], np.int32)),
])
def test_unsupported_inputs_are_refused_not_ignored(name, value):
    assert "kvshare does not support" in refused(name, **{name: value})


@pytest.mark.parametrize("name,value", [
    ("lora_weights", np.zeros((1, 0, 0), np.float16)), ("prompt_vocab_size", np.array([[0]], np.int32)),
    ("guided_decoding_guide_type", np.array([[b"none"]], dtype=object)),
    ("guided_decoding_guide_type", np.array([[b""]], dtype=object)),
    ("guided_decoding_guide", np.array([[b""]], dtype=object)), ("decoder_text_input", np.array([[b""]], dtype=object)),
    ("num_draft_tokens", np.array([[0]], np.int32)), ("use_draft_logits", np.array([[False]])),
    ("beam_search_diversity_rate", np.array([[0.0]], np.float32)), ("early_stopping", np.array([[False]])),
    ("runtime_top_p_decay", np.array([[1.0]], np.float32)), ("stop", np.array([[False]])),
    ("no_repeat_ngram_size", np.array([[0]], np.int32)),
])
def test_neutral_values_of_unsupported_inputs_pass(name, value):
    assert len(parse(**{name: value})) == 1


def test_every_unsupported_input_has_a_neutral_rule():
    assert all(t.neutral is not None for t in contract.UNSUPPORTED)
    assert not contract.BY_NAME["lora_task_id"].neutral(np.array([[0]], np.uint64))


def test_a_batch_is_split_into_rows_and_first_dim_one_broadcasts():
    reqs = parse(input_ids=np.array([[1, 2, 3], [4, 5, 0]], np.int32), input_lengths=np.array([[3], [2]], np.int32),
                 max_tokens=np.array([[5], [6]], np.int32), temperature=np.array([[0.0]], np.float32),
                 stop_words=np.array([[b"a", b""], [b"b", b"c"]], dtype=object))
    assert [r.prompt_ids for r in reqs] == [[1, 2, 3], [4, 5]]
    assert [r.params.max_tokens for r in reqs] == [5, 6] and all(r.params.temperature == 0.0 for r in reqs)
    assert [r.params.stop for r in reqs] == [("a",), ("b", "c")]
    assert [(r.batch_index, r.batch_size) for r in reqs] == [(0, 2), (1, 2)]
    assert [r.prompt_ids for r in parse(input_ids=np.array([[1, 2], [3, 4]], np.int32))] == [[1, 2], [3, 4]]
    assert parse(input_ids=np.array([7, 8], np.int32))[0].prompt_ids == [7, 8]


def test_a_batch_dimension_that_is_neither_one_nor_b_is_refused():
    ids = np.array([[1], [2], [3]], np.int32)
    assert "3 rows" in refused("max_tokens", input_ids=ids, max_tokens=np.array([[1], [2]], np.int32))
    refused("input_lengths", input_ids=ids, input_lengths=np.array([[1], [5], [1]], np.int32))
    refused("input_ids", input_ids=ids, input_lengths=np.array([[1], [0], [1]], np.int32))
    # a bad value in any row is refused
    refused("temperature", input_ids=ids, temperature=np.array([[1.0], [-1.0], [1.0]], np.float32))


def test_text_requests_of_b_rows_are_validated_whole():
    texts = text_prompts(getter(text_input=np.array([[b"a"], [b"b"]], dtype=object)))
    assert texts == ["a", "b"]
    with pytest.raises(InvalidRequest, match="^text_input"):
        text_prompts(getter(text_input=np.array([[b"a"], [b" "]], dtype=object)))
    with pytest.raises(InvalidRequest, match="^max_tokens"):
        text_prompts(getter(text_input=np.array([[b"a"]], dtype=object), max_tokens=np.array([[0]], np.int32)))
    with pytest.raises(InvalidRequest, match="^lora_task_id"):
        text_prompts(getter(text_input=np.array([[b"a"]], dtype=object), lora_task_id=np.array([[1]], np.uint64)))


class _Tok:
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def _prompter():
    p = TextPrompter.__new__(TextPrompter)
    p.tokenizer, p.default_chat, p.params, p.limits = _Tok(), False, {}, PromptLimits()
    return p


def test_text_prompter_pads_rows_and_reports_lengths():
    ids, lengths = _prompter().token_tensors(getter(text_input=np.array([[b"abc"], [b"d"]], dtype=object)))
    assert ids.dtype == np.int32 and ids.tolist() == [[97, 98, 99], [100, 0, 0]]
    assert lengths.dtype == np.int32 and lengths.tolist() == [[3], [1]]
    assert _prompter().prompt_ids(getter(text_input=np.array([[b"ab"]], dtype=object))) == [97, 98]
    with pytest.raises(InvalidRequest, match="^apply_chat_template"):
        _prompter().prompts(getter(text_input=np.array([[b"ab"]], dtype=object), apply_chat_template=np.array([[True]])))
    assert pad_rows([[1], [2, 3]])[0].tolist() == [[1, 0], [2, 3]]
