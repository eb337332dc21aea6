"""The wire contract as one table: every input and output of kvshare's Triton models.

`ensemble` and `llm_bls` speak TensorRT-LLM's contract (the inputs and outputs of its
`inflight_batcher_llm/{ensemble,tensorrt_llm_bls}/config.pbtxt`, same names, types and dims, plus the
older names tools still send); `llm_engine` is the token model (TensorRT-LLM's `tensorrt_llm`
counterpart); `vllm_model` speaks Triton's vLLM backend. This table drives the model configs
(scripts/generate_model_repository.py), the parser (inputs.py: aliases, refusals, batch rows),
llm_bls's pass-through list and docs/integrate/contract.md. No Triton or torch imports.

Roles:
  text         text the text models tokenize (text_input)
  tokens       the token model's prompt (input_ids, input_lengths)
  sampling     read by the parser into SamplingParams / GenerationRequest
  alias        an older TensorRT-LLM name of a sampling input (same meaning, one of the two per request)
  unsupported  declared so that a client sending it gets INVALID_ARG "<name>: kvshare does not support ..."
               (a *neutral* value, one that asks for nothing, passes)
  kvshare      kvshare's own inputs (cache_salt, ignore_eos, apply_chat_template)
  control      llm_bls's side channel to llm_engine (request_key, cancel_request_key)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

ENSEMBLE, BLS, ENGINE, PREPROCESSING, VLLM = "ensemble", "llm_bls", "llm_engine", "preprocessing", "vllm_model"
TEXT = frozenset({ENSEMBLE, BLS})
ALL = frozenset({ENSEMBLE, BLS, ENGINE})
MAX_BATCH_SIZE = 64            # ensemble, llm_bls, preprocessing; llm_engine's must be >= this
ENGINE_MAX_BATCH_SIZE = 64
MAX_BEAM_WIDTH = 8             # beam_width and num_return_sequences above this are refused
MAX_RETURN_SEQUENCES = 8

# vllm_model's sampling_parameters keys -> what kvshare does: vllm_params.py parses exactly these, and
# docs/integrate/contract.md is generated from this
KEY_DOCS: dict[str, str] = {
    "n": "1..8 sequences forked from one prefill",
    "best_of": "null or <= n (no extra candidates are generated)",
    "temperature": ">= 0, 0 = greedy",
    "top_p": "(0, 1]",
    "top_k": "-1 or 0 = off, else >= 1",
    "min_p": "0 only",
    "seed": "0 <= seed < 2**64",
    "presence_penalty": "[-2, 2]",
    "frequency_penalty": "[-2, 2]",
    "repetition_penalty": "> 0",
    "stop": "a string or a list of strings (empty strings dropped); matched on decoded text, not emitted",
    "stop_token_ids": "token ids that end generation in addition to EOS (returned separately: the model adds its EOS)",
    "bad_words": "list of words never generated (as TRT-LLM's bad_words)",
    "ignore_eos": "run to max_tokens (stop_token_ids still stop)",
    "max_tokens": ">= 1; null: the server's default_max_tokens",
    "min_tokens": ">= 0",
    "logprobs": "null, or k >= 0: the sampled token's log-probability plus the k most likely",
    "logit_bias": "{token id (string or int): bias (finite)}",
    "skip_special_tokens": "true only",
    "include_stop_str_in_output": "false only",
    "detokenize": "true only",
    "spaces_between_special_tokens": "true only",
    "prompt_logprobs": "null only",
    "use_beam_search": "false only (vLLM's beam search is its own API)",
    "allowed_token_ids": "null only",
    "truncate_prompt_tokens": "null only",
    "structured_outputs": "refused (structured outputs are not supported)",
    "guided_decoding": "refused (guided decoding is not supported)",
    "lora_name": "refused (LoRA is not supported)",
}


# -- neutral values of unsupported inputs: what a client may send without asking for the feature --------
def _strings(arr: np.ndarray) -> list[str]:
    out = []
    for v in arr.reshape(-1):
        if isinstance(v, (bytes, np.bytes_)):
            v = bytes(v).decode("utf-8", "replace")
        out.append(str(v))
    return out


def empty(arr: np.ndarray) -> bool:
    """No elements (or, for a string tensor, only empty strings)."""
    if arr.size == 0:
        return True
    if arr.dtype == np.object_ or arr.dtype.kind in ("S", "U"):
        return all(not s for s in _strings(arr))
    return False


def _empty_strings(arr: np.ndarray) -> bool:
    return arr.size == 0 or all(not s.strip() for s in _strings(arr))


def _guide_type_none(arr: np.ndarray) -> bool:
    return arr.size == 0 or all(s.strip().lower() in ("", "none") for s in _strings(arr))


def _all(pred: Callable[[float], bool]) -> Callable[[np.ndarray], bool]:
    def check(arr: np.ndarray) -> bool:
        try:
            return all(pred(float(v)) for v in arr.reshape(-1))
        except (TypeError, ValueError):
            return False
    return check


def _never(arr: np.ndarray) -> bool:
    return False


_zero = _all(lambda v: v == 0)
_false = _all(lambda v: v == 0)


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str                       # config data_type, e.g. "TYPE_INT32"
    dims: tuple[int, ...]            # per item (the batch dimension is added by Triton)
    models: frozenset[str]           # which of ensemble / llm_bls / llm_engine declare it
    role: str
    kvshare: str                     # what kvshare does with it (docs/integrate/contract.md)
    trtllm: str = ""                 # what the reference does, where it differs or needs saying
    canonical: str | None = None     # role "alias": the current name
    neutral: Callable[[np.ndarray], bool] | None = None   # role "unsupported": values that ask for nothing
    required: bool = False           # required in kvshare's config (text_input is not: see the generator)
    reference_required: bool = False  # required in TensorRT-LLM's config


def _s(name, dtype, dims, models, kvshare, **kw) -> Tensor:
    return Tensor(name, dtype, dims, frozenset(models), "sampling", kvshare, **kw)


def _u(name, dtype, dims, models, feature, neutral, neutral_text, **kw) -> Tensor:
    return Tensor(name, dtype, dims, frozenset(models), "unsupported",
                  f"refused: kvshare does not support {feature} (accepted only as {neutral_text})",
                  neutral=neutral, **kw)


def _a(name, dtype, canonical, models=ALL, trtllm="") -> Tensor:
    return Tensor(name, dtype, (1,), frozenset(models), "alias", f"older name of `{canonical}` (send one of the two)",
                  trtllm=trtllm, canonical=canonical)


_BLS_ONLY = frozenset({BLS})

INPUTS: tuple[Tensor, ...] = (
    # text and tokens
    Tensor("text_input", "TYPE_STRING", (1,), TEXT, "text", "the prompt (UTF-8, non-empty); [B,1] is B prompts",
           reference_required=True),
    _u("decoder_text_input", "TYPE_STRING", (1,), TEXT, "encoder-decoder models", _empty_strings, '""'),
    _u("image_input", "TYPE_FP16", (-1, 3, -1, -1), _BLS_ONLY, "multimodal inputs", empty, "an empty tensor"),
    _u("image_bytes_input", "TYPE_UINT8", (-1, -1, -1, -1), _BLS_ONLY, "multimodal inputs", empty, "an empty tensor"),
    _u("image_url_input", "TYPE_STRING", (1,), _BLS_ONLY, "multimodal inputs", _empty_strings, '""'),
    _u("image_sizes_input", "TYPE_INT64", (-1, 2), _BLS_ONLY, "multimodal inputs", empty, "an empty tensor"),
    _u("video_bytes_input", "TYPE_UINT8", (-1, -1, -1, -1), _BLS_ONLY, "multimodal inputs", empty, "an empty tensor"),
    Tensor("input_ids", "TYPE_INT32", (-1,), frozenset({ENGINE}), "tokens",
           "prompt token ids; [B,L] is B prompts (rows padded to L, see input_lengths)", required=True,
           reference_required=True),
    Tensor("input_lengths", "TYPE_INT32", (1,), frozenset({ENGINE}), "tokens",
           "optional: row b's prompt is input_ids[b, :input_lengths[b]] (default: the whole row)",
           reference_required=True),
    # generation
    _s("max_tokens", "TYPE_INT32", (1,), ALL, "SamplingParams.max_tokens (> 0); optional: the server's "
       "default_max_tokens", reference_required=True),
    _s("num_return_sequences", "TYPE_INT32", (1,), ALL, "1..8 sequences forked from one prefill, one response stream "
       "each (sequence_index); with beam_width > 1: how many beams to return (<= beam_width, default beam_width)",
       trtllm="the TRT-LLM BLS ignores it"),
    _s("bad_words", "TYPE_STRING", (-1,), ALL, "GenerationRequest.bad_words: one word per element, never generated "
       "(token sequences, as TRT-LLM); empty strings are dropped"),
    _s("stop_words", "TYPE_STRING", (-1,), ALL, "SamplingParams.stop: one word per element, matched on decoded text, "
       "never emitted; empty strings are dropped"),
    _s("exclude_input_in_output", "TYPE_BOOL", (1,), ALL, "default **true** (the prompt is not echoed)",
       trtllm="TRT-LLM's default is false (non-streaming output echoes the prompt)"),
    _s("end_id", "TYPE_INT32", (1,), ALL, "SamplingParams.end_ids = (end_id,); -1: no token ends generation "
       "(runs to max_tokens); default: the model's EOS"),
    _s("pad_id", "TYPE_INT32", (1,), ALL, "GenerationRequest.pad_id (pads beams of unequal length in output_ids); "
       ">= -1"),
    _s("top_k", "TYPE_INT32", (1,), ALL, "SamplingParams.top_k (>= 0, 0 = off)"),
    _s("top_p", "TYPE_FP32", (1,), ALL, "SamplingParams.top_p in [0, 1]; 0 = off, and top_p 0 with top_k 0 is greedy "
       "(TRT-LLM's rule)"),
    _s("temperature", "TYPE_FP32", (1,), ALL, "SamplingParams.temperature (>= 0, 0 = greedy)"),
    _s("length_penalty", "TYPE_FP32", (1,), ALL, "SamplingParams.length_penalty (finite): beams rank by "
       "cum_logprob / len ** length_penalty; default 1.0"),
    _s("repetition_penalty", "TYPE_FP32", (1,), ALL, "SamplingParams.repetition_penalty (> 0, 1 = off)"),
    _s("min_tokens", "TYPE_INT32", (1,), ALL, "SamplingParams.min_tokens (>= 0)"),
    _s("presence_penalty", "TYPE_FP32", (1,), ALL, "SamplingParams.presence_penalty in [-2, 2]"),
    _s("frequency_penalty", "TYPE_FP32", (1,), ALL, "SamplingParams.frequency_penalty in [-2, 2]"),
    _s("seed", "TYPE_UINT64", (1,), ALL, "SamplingParams.seed: same seed + same inputs = same output"),
    _s("return_log_probs", "TYPE_BOOL", (1,), ALL, "SamplingParams.logprobs = 0: cum_log_probs, output_log_probs"),
    _s("return_context_logits", "TYPE_BOOL", (1,), ALL, "context_logits [prompt_len, vocab]"),
    _s("return_generation_logits", "TYPE_BOOL", (1,), ALL, "generation_logits [beams, gen_len, vocab]"),
    _s("return_perf_metrics", "TYPE_BOOL", (1,), ALL, "kv_cache_*_blocks (pages), *_time_ns; the speculative-"
       "decoding outputs are 0"),
    _s("return_num_input_tokens", "TYPE_BOOL", (1,), ALL, "num_input_tokens on the first response"),
    _s("return_num_output_tokens", "TYPE_BOOL", (1,), ALL, "num_output_tokens: the tokens of each response"),
    _s("beam_width", "TYPE_INT32", (1,), ALL, "1..8 (0 is refused, as TRT-LLM does); > 1: deterministic beam search "
       "ranked by the raw log-probabilities; temperature must be 0 or 1 and top_k/top_p off (0 or 1), no stop/bad "
       "words, embedding bias, penalties or min_tokens; streaming is accepted and sends the beams at the end"),
    _s("stream", "TYPE_BOOL", (1,), ALL, "true: one response per text delta; false: one response"),
    _u("prompt_embedding_table", "TYPE_FP16", (-1, -1), ALL, "prompt tuning", empty, "an empty tensor"),
    _u("prompt_table_extra_id", "TYPE_UINT64", (1,), ALL, "prompt tuning", _zero, "0"),
    _u("prompt_vocab_size", "TYPE_INT32", (1,), ALL, "prompt tuning", _zero, "0"),
    _s("embedding_bias_words", "TYPE_STRING", (-1,), ALL, "GenerationRequest.embedding_bias: every token of word i "
       "gets embedding_bias_weights[i] added to its logit (equal lengths; empty words dropped)"),
    _s("embedding_bias_weights", "TYPE_FP32", (-1,), ALL, "see embedding_bias_words (finite)"),
    _u("num_draft_tokens", "TYPE_INT32", (1,), _BLS_ONLY, "speculative decoding", _zero, "0"),
    _u("use_draft_logits", "TYPE_BOOL", (1,), _BLS_ONLY, "speculative decoding", _false, "false"),
    _u("lora_task_id", "TYPE_UINT64", (1,), ALL, "LoRA", _never, "absent: every task id, 0 included, names an adapter"),
    _u("lora_weights", "TYPE_FP16", (-1, -1), ALL, "LoRA", empty, "an empty tensor"),
    _u("lora_config", "TYPE_INT32", (-1, 3), ALL, "LoRA", empty, "an empty tensor"),
    _u("guided_decoding_guide_type", "TYPE_STRING", (1,), ALL, "guided decoding", _guide_type_none, '"" or "none"'),
    _u("guided_decoding_guide", "TYPE_STRING", (1,), ALL, "guided decoding", _empty_strings, '""'),
    # older names (tensorrtllm_backend <= v0.19 ensemble/BLS, and the tensorrt_llm model's names)
    _a("min_length", "TYPE_INT32", "min_tokens", trtllm="ensemble/BLS name up to v0.19; genai-perf sends it"),
    _a("random_seed", "TYPE_UINT64", "seed", trtllm="ensemble/BLS name up to v0.19"),
    _a("return_kv_cache_reuse_stats", "TYPE_BOOL", "return_perf_metrics", trtllm="v0.16-v0.18"),
    _a("request_output_len", "TYPE_INT32", "max_tokens", trtllm="tensorrt_llm model name"),
    _a("runtime_top_k", "TYPE_INT32", "top_k", trtllm="tensorrt_llm model name"),
    _a("runtime_top_p", "TYPE_FP32", "top_p", trtllm="tensorrt_llm model name"),
    _a("len_penalty", "TYPE_FP32", "length_penalty", trtllm="tensorrt_llm model name"),
    _a("streaming", "TYPE_BOOL", "stream", trtllm="tensorrt_llm model name"),
    # inputs of TensorRT-LLM's tensorrt_llm model that the token model declares and refuses
    _u("stop", "TYPE_BOOL", (1,), {ENGINE}, "stopping a request by a second request (cancel the request instead)",
       _false, "false"),
    _u("runtime_top_p_min", "TYPE_FP32", (1,), {ENGINE}, "top-p decay", _all(lambda v: v <= 1e-6), "<= 1e-6 (TRT-LLM's default)"),
    _u("runtime_top_p_decay", "TYPE_FP32", (1,), {ENGINE}, "top-p decay", _all(lambda v: v == 1.0), "1.0"),
    _u("runtime_top_p_reset_ids", "TYPE_INT32", (1,), {ENGINE}, "top-p decay", _all(lambda v: v < 0), "-1"),
    _u("early_stopping", "TYPE_BOOL", (1,), {ENGINE}, "early stopping of beam search (it runs HF's early_stopping="
       "False)", _false, "false"),
    _u("beam_search_diversity_rate", "TYPE_FP32", (1,), {ENGINE}, "diverse beam search", _zero, "0"),
    _u("no_repeat_ngram_size", "TYPE_INT32", (1,), {ENGINE}, "no-repeat n-grams",
       _all(lambda v: v <= 0 or v >= 1 << 30), "0 or >= 2**30"),
    _u("draft_input_ids", "TYPE_INT32", (-1,), {ENGINE}, "speculative decoding", empty, "an empty tensor"),
    _u("decoder_input_ids", "TYPE_INT32", (-1,), {ENGINE}, "encoder-decoder models", empty, "an empty tensor"),
    _u("prompt_table_extra_ids", "TYPE_UINT64", (-1,), {ENGINE}, "prompt tuning", _zero, "0s"),
    _u("lookahead_window_size", "TYPE_INT32", (1,), {ENGINE}, "lookahead decoding", _zero, "0"),
    _u("lookahead_ngram_size", "TYPE_INT32", (1,), {ENGINE}, "lookahead decoding", _zero, "0"),
    _u("lookahead_verification_set_size", "TYPE_INT32", (1,), {ENGINE}, "lookahead decoding", _zero, "0"),
    # kvshare's own
    Tensor("cache_salt", "TYPE_STRING", (1,), ALL, "kvshare", "prefixes are shared only between requests with the "
           "same salt"),
    Tensor("ignore_eos", "TYPE_BOOL", (1,), ALL, "kvshare", "SamplingParams.ignore_eos: run to max_tokens"),
    Tensor("apply_chat_template", "TYPE_BOOL", (1,), TEXT, "kvshare", "wrap text_input in the model's chat template "
           "(default: the model's `apply_chat_template` parameter)"),
    Tensor("request_key", "TYPE_STRING", (1,), frozenset({ENGINE}), "control", "llm_bls: the inner request's key"),
    Tensor("cancel_request_key", "TYPE_STRING", (1,), frozenset({ENGINE}), "control",
           "llm_bls: cancel the request with this key"),
)

OUTPUTS: tuple[Tensor, ...] = tuple(Tensor(n, t, d, ALL, "output", k) for n, t, d, k in (
    ("text_output", "TYPE_STRING", (-1,), "the new text (a delta when streaming; the prompt first when "
     "exclude_input_in_output is false and not streaming); one element per returned beam"),
    ("cum_log_probs", "TYPE_FP32", (-1,), "return_log_probs: cumulative log-probability, per beam"),
    ("output_log_probs", "TYPE_FP32", (-1, -1), "return_log_probs: [beams, tokens] of this response"),
    ("context_logits", "TYPE_FP32", (-1, -1), "return_context_logits: [prompt_len, vocab]"),
    ("generation_logits", "TYPE_FP32", (-1, -1, -1), "return_generation_logits: [beams, tokens, vocab]"),
    ("batch_index", "TYPE_INT32", (1,), "the row of a [B,...] request this response answers"),
    ("sequence_index", "TYPE_INT32", (1,), "which of num_return_sequences this response belongs to"),
    ("kv_cache_alloc_new_blocks", "TYPE_INT32", (1,), "return_perf_metrics: KV pages the request allocated"),
    ("kv_cache_reused_blocks", "TYPE_INT32", (1,), "return_perf_metrics: KV pages reused from the prefix cache"),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32", (1,), "return_perf_metrics: KV pages in its page table"),
    ("arrival_time_ns", "TYPE_INT64", (1,), "return_perf_metrics"),
    ("first_scheduled_time_ns", "TYPE_INT64", (1,), "return_perf_metrics"),
    ("first_token_time_ns", "TYPE_INT64", (1,), "return_perf_metrics"),
    ("last_token_time_ns", "TYPE_INT64", (1,), "return_perf_metrics"),
    ("acceptance_rate", "TYPE_FP32", (1,), "return_perf_metrics: 0 (no speculative decoding)"),
    ("total_accepted_draft_tokens", "TYPE_INT32", (1,), "return_perf_metrics: 0"),
    ("total_draft_tokens", "TYPE_INT32", (1,), "return_perf_metrics: 0"),
    ("num_input_tokens", "TYPE_INT32", (1,), "return_num_input_tokens: prompt tokens"),
    ("num_output_tokens", "TYPE_INT32", (1,), "return_num_output_tokens: tokens of this response"),
    ("output_ids", "TYPE_INT32", (-1,), "kvshare: the new tokens of this response"),
    ("finish_reason", "TYPE_STRING", (1,), "kvshare: stop, length, cancelled or error on the final response"),
    ("cached_tokens", "TYPE_INT32", (1,), "kvshare: prompt tokens served from shared pages"),
))
KVSHARE_OUTPUTS = frozenset({"output_ids", "finish_reason", "cached_tokens"})

# Triton's vLLM backend contract (vllm_model): max_batch_size 0, so dims are the wire shape.
VLLM_INPUTS: tuple[Tensor, ...] = tuple(Tensor(n, t, (1,) if n != "image" else (-1,), frozenset({VLLM}), r, k,
                                               required=(n == "text_input"), reference_required=(n == "text_input"))
                                        for n, t, r, k in (
    ("text_input", "TYPE_STRING", "text", "the prompt"),
    ("image", "TYPE_STRING", "unsupported", "refused: kvshare does not support multimodal inputs"),
    ("stream", "TYPE_BOOL", "sampling", "true: text deltas"),
    ("sampling_parameters", "TYPE_STRING", "sampling", "vLLM SamplingParams as JSON (vllm_params.py); absent: the "
     "request's parameters"),
    ("exclude_input_in_output", "TYPE_BOOL", "sampling", "absent: true when streaming, false otherwise (vLLM backend)"),
    ("return_finish_reason", "TYPE_BOOL", "sampling", "finish_reason output"),
    ("return_cumulative_logprob", "TYPE_BOOL", "sampling", "cumulative_logprob output"),
    ("return_logprobs", "TYPE_BOOL", "sampling", "logprobs output (needs sampling_parameters.logprobs)"),
    ("return_num_input_tokens", "TYPE_BOOL", "sampling", "num_input_tokens output"),
    ("return_num_output_tokens", "TYPE_BOOL", "sampling", "num_output_tokens output"),
    ("embedding_request", "TYPE_STRING", "unsupported", "refused: kvshare does not serve embeddings"),
))
VLLM_OUTPUTS: tuple[Tensor, ...] = tuple(Tensor(n, t, d, frozenset({VLLM}), "output", "") for n, t, d in (
    ("text_output", "TYPE_STRING", (-1,)), ("finish_reason", "TYPE_STRING", (-1,)),
    ("cumulative_logprob", "TYPE_FP32", (-1,)), ("logprobs", "TYPE_STRING", (-1,)),
    ("num_input_tokens", "TYPE_UINT32", (1,)), ("num_output_tokens", "TYPE_UINT32", (-1,))))


BY_NAME: dict[str, Tensor] = {t.name: t for t in INPUTS}
ALIASES: dict[str, tuple[str, ...]] = {}
for _t in INPUTS:
    if _t.role == "alias":
        ALIASES[_t.canonical] = ALIASES.get(_t.canonical, ()) + (_t.name,)
UNSUPPORTED: tuple[Tensor, ...] = tuple(t for t in INPUTS if t.role == "unsupported")


def inputs_of(model: str) -> list[Tensor]:
    """The inputs a model's config declares, in table order (preprocessing: every ensemble input)."""
    if model == PREPROCESSING:
        model = ENSEMBLE
    if model == VLLM:
        return list(VLLM_INPUTS)
    return [t for t in INPUTS if model in t.models]


def forwarded_to_engine(model: str) -> list[str]:
    """Inputs a text model hands to llm_engine as they came: every one both declare, except the prompt."""
    engine = {t.name for t in inputs_of(ENGINE)}
    return [t.name for t in inputs_of(model) if t.name in engine and t.role not in ("tokens", "text", "control")]


def outputs_of(model: str) -> list[Tensor]:
    return list(VLLM_OUTPUTS) if model == VLLM else list(OUTPUTS)


def refuse_unsupported(get, field_prefix: str = "") -> None:
    """INVALID_ARG for the first unsupported input sent with a non-neutral value (get: name -> array | None)."""
    from ..engine.outputs import InvalidRequest
    for t in UNSUPPORTED:
        arr = get(t.name)
        if arr is not None and not t.neutral(np.asarray(arr)):
            raise InvalidRequest(field_prefix + t.name, t.kvshare.removeprefix("refused: "))


def _dims(d: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(x) for x in d) + "]"


@dataclass(frozen=True)
class EngineParameter:
    """A `parameters` entry of llm_engine's config.pbtxt (an EngineConfig field; KVSHARE_<NAME> overrides it)."""
    name: str
    default: str
    doc: str


ENGINE_PARAMETERS: tuple[EngineParameter, ...] = (
    EngineParameter("page_size", "16", "tokens per KV page"),
    EngineParameter("kv_cache_memory_gb", "1.0", "the page pool's memory per engine (per device; num_pages overrides it)"),
    EngineParameter("kv_cache_dtype", "auto", "auto (the model's dtype) | fp8_e4m3 | int8: 8-bit KV pages, about "
                    "twice the pages in the same memory (docs/operate/tune.md)"),
    EngineParameter("cpu_weights", "blocks", "CPU: blocks keeps a GGUF's quantized linear layers in its blocks, "
                    "read by kvshare's CPU kernel (the same weight values, about a fifth of the bytes); fp32 widens "
                    "them at load (docs/operate/tune.md)"),
    EngineParameter("max_running", "32", "sequences decoding at once per engine"),
    EngineParameter("default_max_tokens", "128", "max_tokens of a request that sends none"),
    EngineParameter("host_cache_memory_gb", "0", "host tier below the pool (pinned memory on CUDA); 0 = off. Pays "
                    "when prefixes come back after the pool evicted them (docs/develop/core.md)"),
    EngineParameter("disk_cache_dir", "", "disk tier below the host tier: a directory of page files that outlives "
                    "the server; empty = off; needs host_cache_memory_gb > 0; one server per directory"),
    EngineParameter("disk_cache_gb", "16", "the disk tier's size bound (least recently written or used pages go)"),
    EngineParameter("data_parallel_size", "1", "engines this instance drives, one page pool and engine thread each "
                    "(docs/develop/engine.md)"),
    EngineParameter("devices", "", "comma-separated devices, one per engine; empty: cuda:0..N-1 on a GPU instance, "
                    "else N on its device"),
    EngineParameter("routing_policy", "cache_aware", "cache_aware (the engine holding the longest cached prefix, "
                    "bounded imbalance) or round_robin"),
)


def render_markdown() -> str:
    """docs/integrate/contract.md: TRT-LLM / vLLM name -> kvshare behaviour, from this table."""
    def models(t: Tensor) -> str:
        return ", ".join(m for m in (ENSEMBLE, BLS, ENGINE) if m in t.models)

    lines = [
        "# kvshare's wire contract, input by input",
        "",
        "Generated from `backend/kvshare/triton_adapter/contract.py` by `scripts/generate_model_repository.py`;",
        "edit the table there. Types and dims are per item (Triton adds the batch dimension on `ensemble`,",
        "`llm_bls` and `llm_engine`, whose `max_batch_size` is "
        f"{MAX_BATCH_SIZE}; `vllm_model` has none).",
        "",
        "General rules:",
        "",
        "- A request with batch dimension B (`[B,1]` tensors) is B generation requests, answered row by row with",
        "  `batch_index`; an input whose first dimension is 1 applies to every row; any other first dimension is",
        "  INVALID_ARG naming the input.",
        "- Every error is INVALID_ARG with a message that starts with the input's name (the name the client sent,",
        "  e.g. `runtime_top_p`, not `top_p`).",
        "- Inputs kvshare does not support are declared with TensorRT-LLM's types and dims and refused when sent",
        "  with a value that asks for something (\"kvshare does not support ...\"); never silently ignored.",
        "- `text_input` is required but declared optional: Triton 2.51's ensemble answers a request that lacks a",
        "  required input with an empty response and no error, so `preprocessing` rejects it by name.",
        "- `max_tokens` is optional (the server's `default_max_tokens`), unlike TensorRT-LLM.",
        "- `exclude_input_in_output` defaults to **true** (TensorRT-LLM: false).",
        "- Beam search (`beam_width` > 1) is deterministic and ranks beams by the raw log-probabilities",
        "  (cum_logprob / len ** length_penalty). TensorRT-LLM's end_to_end client always sends",
        "  temperature 1.0, so temperature 0 and 1 are accepted with beams (both mean \"no temperature\"), as are",
        "  top_k 0/1 and top_p 0/1 (the inflight client's defaults); other values are refused, and so are stop",
        "  words, bad words, embedding bias, penalties and min_tokens, which the beam search does not apply.",
        "  Streaming is accepted with beams: the beams come at the end. `num_return_sequences` (default",
        "  `beam_width`) is how many of the best beams are returned.",
        "- `top_p` 0 means top-p off; with `top_k` 0 (or absent) it means greedy, as in TensorRT-LLM.",
        "- `end_id` -1 means no token ends generation (TensorRT-LLM's inflight client sends -1 without a tokenizer).",
        "",
        "## Inputs of `ensemble`, `llm_bls`, `llm_engine`",
        "",
        "| name | type | dims | models | TensorRT-LLM | kvshare |",
        "|---|---|---|---|---|---|",
    ]
    for t in INPUTS:
        ref = t.trtllm or ("required" if t.reference_required else "")
        lines.append(f"| `{t.name}` | {t.dtype.removeprefix('TYPE_')} | {_dims(t.dims)} | {models(t)} | {ref} | "
                     f"{t.kvshare} |")
    lines += ["", "## Outputs (all three models; `ensemble` maps every `llm_engine` output through)", "",
              "| name | type | dims | kvshare |", "|---|---|---|---|"]
    for t in OUTPUTS:
        lines.append(f"| `{t.name}` | {t.dtype.removeprefix('TYPE_')} | {_dims(t.dims)} | {t.kvshare} |")
    lines += ["", "## `vllm_model` (Triton's vLLM backend contract; max_batch_size 0, decoupled)", "",
              "| input | type | dims | kvshare |", "|---|---|---|---|"]
    for t in VLLM_INPUTS:
        lines.append(f"| `{t.name}` | {t.dtype.removeprefix('TYPE_')} | {_dims(t.dims)} | "
                     f"{'required; ' if t.required else ''}{t.kvshare} |")
    lines += ["", "| output | type | dims |", "|---|---|---|"]
    for t in VLLM_OUTPUTS:
        lines.append(f"| `{t.name}` | {t.dtype.removeprefix('TYPE_')} | {_dims(t.dims)} |")
    lines += ["", "### `sampling_parameters` keys (vLLM `SamplingParams`; `backend/kvshare/triton_adapter/vllm_params.py`)", "",
              "Values may be strings (genai-perf and vLLM's sample client send `\"100\"`, `\"0.1\"`): they are cast by",
              "the key's type, and `\"true\"`/`\"false\"` parse as booleans. A key whose value is null is unset. Any other",
              "key, or a value kvshare cannot honour, is INVALID_ARG `sampling_parameters.<key>: ...`. Without a",
              "`sampling_parameters` tensor the request's parameters are read the same way (`parameters.<key>`);",
              "there the vLLM model's own input names (`stream`, `exclude_input_in_output`, `return_*`) are taken as",
              "those inputs, and `id` and `triton_*` keys are Triton's and skipped.", "",
              "| key | kvshare |", "|---|---|"]
    for key, doc in KEY_DOCS.items():
        lines.append(f"| `{key}` | {doc} |")
    lines += ["", "## `llm_engine` parameters (config.pbtxt; `KVSHARE_<NAME>` environment variables override them)", "",
              "Every field of `EngineConfig` (`backend/kvshare/engine/engine_config.py`) and `ParallelConfig`",
              "(`backend/kvshare/engine/data_parallel.py`) may be set this way; these are the ones the generated",
              "config spells out.", "", "| parameter | default | meaning |", "|---|---|---|"]
    for p in ENGINE_PARAMETERS:
        default = p.default or '""'
        lines.append(f"| `{p.name}` | `{default}` | {p.doc} |")
    return "\n".join(lines) + "\n"
