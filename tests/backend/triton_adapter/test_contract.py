"""The generated model configs against the reference contracts, written out here independently of contract.py.

The expected lists are TensorRT-LLM's `inflight_batcher_llm/{ensemble,tensorrt_llm_bls}/config.pbtxt`
(newest; older names from tensorrtllm_backend tags <= v0.19 and the tensorrt_llm model) and Triton's
vLLM backend (auto_complete_config), as gathered in the contract spec (§1.2-§1.6, §6).
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvshare.triton_adapter import contract

ROOT = Path(__file__).resolve().parents[3]
REPO = ROOT / "model_repository"

I32, U64, F32, F16, BOOL, STR, U8, I64, U32 = ("TYPE_INT32", "TYPE_UINT64", "TYPE_FP32", "TYPE_FP16", "TYPE_BOOL",
                                               "TYPE_STRING", "TYPE_UINT8", "TYPE_INT64", "TYPE_UINT32")
S = (1,)
TRTLLM_ENSEMBLE_INPUTS = {
    "text_input": (STR, S), "decoder_text_input": (STR, S), "max_tokens": (I32, S),
    "num_return_sequences": (I32, S), "bad_words": (STR, (-1,)), "stop_words": (STR, (-1,)),
    "exclude_input_in_output": (BOOL, S), "end_id": (I32, S), "pad_id": (I32, S), "top_k": (I32, S),
    "top_p": (F32, S), "temperature": (F32, S), "length_penalty": (F32, S), "repetition_penalty": (F32, S),
    "min_tokens": (I32, S), "presence_penalty": (F32, S), "frequency_penalty": (F32, S), "seed": (U64, S),
    "return_log_probs": (BOOL, S), "return_context_logits": (BOOL, S), "return_generation_logits": (BOOL, S),
    "return_perf_metrics": (BOOL, S), "return_num_input_tokens": (BOOL, S), "return_num_output_tokens": (BOOL, S),
    "beam_width": (I32, S), "stream": (BOOL, S), "prompt_embedding_table": (F16, (-1, -1)),
    "prompt_table_extra_id": (U64, S), "prompt_vocab_size": (I32, S), "embedding_bias_words": (STR, (-1,)),
    "embedding_bias_weights": (F32, (-1,)), "lora_task_id": (U64, S), "lora_weights": (F16, (-1, -1)),
    "lora_config": (I32, (-1, 3)), "guided_decoding_guide_type": (STR, S), "guided_decoding_guide": (STR, S),
}
TRTLLM_BLS_INPUTS = {
    **TRTLLM_ENSEMBLE_INPUTS, "image_input": (F16, (-1, 3, -1, -1)), "image_bytes_input": (U8, (-1, -1, -1, -1)),
    "image_url_input": (STR, S), "image_sizes_input": (I64, (-1, 2)), "video_bytes_input": (U8, (-1, -1, -1, -1)),
    "num_draft_tokens": (I32, S), "use_draft_logits": (BOOL, S),
}
OLD_NAMES = {  # name: (dtype of the configs that used it, current name)
    "min_length": (I32, "min_tokens"), "random_seed": (U64, "seed"), "runtime_top_k": (I32, "top_k"),
    "runtime_top_p": (F32, "top_p"), "len_penalty": (F32, "length_penalty"), "streaming": (BOOL, "stream"),
    "return_kv_cache_reuse_stats": (BOOL, "return_perf_metrics"), "request_output_len": (I32, "max_tokens"),
}
TRTLLM_OUTPUTS = {
    "text_output": (STR, (-1,)), "cum_log_probs": (F32, (-1,)), "output_log_probs": (F32, (-1, -1)),
    "context_logits": (F32, (-1, -1)), "generation_logits": (F32, (-1, -1, -1)), "batch_index": (I32, S),
    "sequence_index": (I32, S), "kv_cache_alloc_new_blocks": (I32, S), "kv_cache_reused_blocks": (I32, S),
    "kv_cache_alloc_total_blocks": (I32, S), "arrival_time_ns": (I64, S), "first_scheduled_time_ns": (I64, S),
    "first_token_time_ns": (I64, S), "last_token_time_ns": (I64, S), "acceptance_rate": (F32, S),
    "total_accepted_draft_tokens": (I32, S), "total_draft_tokens": (I32, S), "num_input_tokens": (I32, S),
    "num_output_tokens": (I32, S),
}
KVSHARE_OUTPUTS = {"output_ids": (I32, (-1,)), "finish_reason": (STR, S), "cached_tokens": (I32, S)}
SAMPLING = [n for n in TRTLLM_ENSEMBLE_INPUTS if n not in ("text_input", "decoder_text_input")]
VLLM_INPUTS = {
    "text_input": (STR, S, False), "image": (STR, (-1,), True), "stream": (BOOL, S, True),
    "sampling_parameters": (STR, S, True), "exclude_input_in_output": (BOOL, S, True),
    "return_finish_reason": (BOOL, S, True), "return_cumulative_logprob": (BOOL, S, True),
    "return_logprobs": (BOOL, S, True), "return_num_input_tokens": (BOOL, S, True),
    "return_num_output_tokens": (BOOL, S, True), "embedding_request": (STR, S, True),
}
VLLM_OUTPUTS = {"text_output": (STR, (-1,)), "finish_reason": (STR, (-1,)), "cumulative_logprob": (F32, (-1,)),
                "logprobs": (STR, (-1,)), "num_input_tokens": (U32, S), "num_output_tokens": (U32, (-1,))}


def parse_config(model: str) -> dict:
    """A small reader of the generated config.pbtxt: top-level scalars, inputs, outputs, steps."""
    text = (REPO / model / "config.pbtxt").read_text()

    def tensors(kind: str) -> dict:
        m = re.search(rf"^{kind} \[\n(.*?)^\]", text, re.S | re.M)
        out = {}
        for blk in re.findall(r"\{(.*?)\n  \}", m.group(1), re.S):
            name = re.search(r'name: "(\w+)"', blk).group(1)
            assert name not in out, f"{model}: {kind} {name} declared twice"
            dims = tuple(int(d) for d in re.search(r"dims: \[ ([^\]]*) \]", blk).group(1).split(","))
            out[name] = (re.search(r"data_type: (\w+)", blk).group(1), dims, "optional: true" in blk)
        return out

    steps = []
    for blk in re.findall(r'model_name: "(\w+)"(.*?)\n    \}', text, re.S):
        steps.append((blk[0], dict(re.findall(r'input_map \{ key: "(\w+)" value: "(\w+)" \}', blk[1])),
                      dict(re.findall(r'output_map \{ key: "(\w+)" value: "(\w+)" \}', blk[1]))))
    return {"max_batch_size": int(re.search(r"^max_batch_size: (\d+)", text, re.M).group(1)),
            "decoupled": "decoupled: true" in text, "inputs": tensors("input"), "outputs": tensors("output"),
            "steps": steps, "text": text}


@pytest.mark.parametrize("model,reference", [("ensemble", TRTLLM_ENSEMBLE_INPUTS), ("llm_bls", TRTLLM_BLS_INPUTS)])
def test_text_models_declare_every_trtllm_input_with_its_type_and_dims(model, reference):
    inputs = parse_config(model)["inputs"]
    for name, (dtype, dims) in reference.items():
        assert name in inputs, f"{model} lacks TRT-LLM input {name}"
        assert inputs[name][:2] == (dtype, dims), f"{model}.{name}: {inputs[name][:2]} != {(dtype, dims)}"
    for name, (dtype, _) in OLD_NAMES.items():
        assert inputs[name][:2] == (dtype, (1,)), f"{model}.{name}"
    # Triton 2.51 ensemble quirk: every input optional (text_input is refused by name in preprocessing)
    assert all(opt for _, _, opt in inputs.values())


@pytest.mark.parametrize("model", ["ensemble", "llm_bls", "llm_engine"])
def test_every_trtllm_output_and_kvshare_output_exists(model):
    outputs = parse_config(model)["outputs"]
    for name, spec in {**TRTLLM_OUTPUTS, **KVSHARE_OUTPUTS}.items():
        assert outputs.get(name, (None, None))[:2] == spec, f"{model}.{name}"


def test_llm_engine_takes_tokens_and_every_sampling_input():
    cfg = parse_config("llm_engine")
    inputs = cfg["inputs"]
    assert inputs["input_ids"] == (I32, (-1,), False)
    assert inputs["input_lengths"] == (I32, (1,), True)
    for name in SAMPLING:
        assert inputs[name][:2] == TRTLLM_ENSEMBLE_INPUTS[name], name
    for name, (dtype, _) in OLD_NAMES.items():
        assert inputs[name][:2] == (dtype, (1,)), name
    assert cfg["decoupled"]
    assert cfg["max_batch_size"] >= parse_config("ensemble")["max_batch_size"]
    assert cfg["max_batch_size"] >= parse_config("llm_bls")["max_batch_size"]


def test_ensemble_feeds_preprocessing_everything_and_maps_the_engine_through():
    ens, pre, eng = parse_config("ensemble"), parse_config("preprocessing"), parse_config("llm_engine")
    (pre_name, pre_in, pre_out), (eng_name, eng_in, eng_out) = ens["steps"]
    assert (pre_name, eng_name) == ("preprocessing", "llm_engine")
    # preprocessing receives every ensemble input (so it runs whenever the client sent anything)
    assert pre_in == {n: n for n in ens["inputs"]}
    assert {n: v[:2] for n, v in pre["inputs"].items()} == {n: v[:2] for n, v in ens["inputs"].items()}
    assert pre["outputs"] == {"input_ids": (I32, (-1,), False), "input_lengths": (I32, (1,), False)}
    assert pre_out == {"input_ids": "_input_ids", "input_lengths": "_input_lengths"}
    # llm_engine: the padded ids with their lengths, and every ensemble input it declares
    assert eng_in.pop("input_ids") == "_input_ids" and eng_in.pop("input_lengths") == "_input_lengths"
    assert eng_in == {n: n for n in ens["inputs"] if n in eng["inputs"]}
    for name in SAMPLING + list(OLD_NAMES):
        assert eng_in.get(name) == name, name
    for name, value in eng_in.items():
        assert eng["inputs"][name][:2] == ens["inputs"][value][:2], name
    assert eng_out == {n: n for n in eng["outputs"]} and set(eng["outputs"]) == set(ens["outputs"])
    for name in ens["outputs"]:
        assert ens["outputs"][name] == eng["outputs"][name]


def test_llm_bls_forwards_every_input_the_engine_declares():
    bls, eng = parse_config("llm_bls")["inputs"], parse_config("llm_engine")["inputs"]
    forwarded = set(contract.forwarded_to_engine("llm_bls"))
    assert forwarded == {n for n in bls if n in eng} - {"input_ids", "input_lengths"}
    assert set(SAMPLING) | set(OLD_NAMES) <= forwarded


def test_vllm_model_speaks_the_vllm_backend_contract():
    cfg = parse_config("vllm_model")
    assert cfg["max_batch_size"] == 0 and cfg["decoupled"]
    assert cfg["inputs"] == {n: (t, d, opt) for n, (t, d, opt) in VLLM_INPUTS.items()}
    assert {n: v[:2] for n, v in cfg["outputs"].items()} == VLLM_OUTPUTS
    assert 'key: "engine_model_name" value: { string_value: "llm_engine" }' in cfg["text"]
    assert (REPO / "vllm_model" / "1" / "model.py").read_text().startswith("from kvshare.triton_adapter.")


def test_aliases_point_at_inputs_of_the_same_type():
    for name, (_, canonical) in OLD_NAMES.items():
        t = contract.BY_NAME[name]
        assert (t.role, t.canonical) == ("alias", canonical)
        assert t.dtype == contract.BY_NAME[canonical].dtype or name == "min_length"


def test_docs_contract_md_is_generated_from_the_table():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts" / "generate_model_repository.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for name, make in gen.DOCS.items():
        assert (ROOT / "docs" / name).read_text() == make(), f"docs/{name} drifted: run the generator"
    text = (ROOT / "docs" / "integrate" / "contract.md").read_text()
    for name in list(TRTLLM_BLS_INPUTS) + list(OLD_NAMES) + list(TRTLLM_OUTPUTS):
        assert f"`{name}`" in text, name


def test_engine_parameters_are_engine_config_fields_with_parseable_defaults():
    from kvshare.engine.data_parallel import ParallelConfig
    from kvshare.engine.engine_config import EngineConfig
    from kvshare.triton_adapter.contract import ENGINE_PARAMETERS

    parallel = ParallelConfig.field_names()
    ParallelConfig.from_mapping({p.name: p.default for p in ENGINE_PARAMETERS if p.name in parallel})
    config = EngineConfig.from_mapping({p.name: p.default for p in ENGINE_PARAMETERS if p.name not in parallel})
    assert config.disk_cache_dir == "" and config.host_cache_memory_gb == 0.0 and config.disk_cache_gb == 16.0
