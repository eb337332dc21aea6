from __future__ import annotations

import pytest

from kvshare.engine.engine_config import EngineConfig
from kvshare.engine.outputs import RequestOutput, coalesce

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def out(rid, text, ids, finished=False, reason=None, n=1):
    return RequestOutput(rid, tuple(ids), text, finished, reason, 5, n, 0)


def test_coalesce_merges_per_request_in_order():
    merged = coalesce([out("a", "He", [1]), out("b", "x", [9]), out("a", "llo", [2], n=2),
                       out("a", "!", [3], True, "stop", n=3)])
    assert [(m.request_id, m.text, m.token_ids, m.finished, m.num_output_tokens) for m in merged] == [
        ("a", "Hello!", (1, 2, 3), True, 3), ("b", "x", (9,), False, 1)]


def test_engine_config_from_strings_and_errors():
    c = EngineConfig.from_mapping({"page_size": "32", "enable_prefix_caching": "false", "num_pages": "none",
                                   "kv_cache_memory_gb": "0.25", "model": "dummy:tiny-llama"})
    assert (c.page_size, c.enable_prefix_caching, c.num_pages, c.kv_cache_memory_gb) == (32, False, None, 0.25)
    with pytest.raises(ValueError, match="page_sise"):
        EngineConfig.from_mapping({"page_sise": "16"})
    with pytest.raises(ValueError, match="max_running"):
        EngineConfig.from_mapping({"max_running": "many"})


@pytest.mark.parametrize("raw, parsed", [("none", None), ("", None), ("true", True), ("False", False)])
def test_overlap_schedule_parses_as_optional_bool(raw, parsed):
    assert EngineConfig.from_mapping({"overlap_schedule": raw}).overlap_schedule is parsed
    with pytest.raises(ValueError, match="overlap_schedule"):
        EngineConfig.from_mapping({"overlap_schedule": "sometimes"})


def test_overlap_defaults_on_for_cuda_only_and_explicit_values_win():
    assert [EngineConfig(device=d).overlap_enabled for d in ("cpu", "cuda", "cuda:1")] == [False, True, True]
    assert EngineConfig(device="cuda", overlap_schedule=False).overlap_enabled is False
    assert EngineConfig(device="cpu", overlap_schedule=True).overlap_enabled is True


def test_committed_model_repository_matches_its_generator(tmp_path):
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts" / "generate_model_repository.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for name, make in gen.CONFIGS.items():
        assert (ROOT / "model_repository" / name / "config.pbtxt").read_text() == make(), \
            f"{name}/config.pbtxt drifted: run python scripts/generate_model_repository.py"


def test_max_prompt_tokens_refuses_a_longer_prompt_naming_input_ids():
    from kvshare.engine.engine import LLMEngine
    from kvshare.engine.outputs import InvalidRequest
    from kvshare.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model="dummy:tiny-llama", num_pages=16, page_size=4, max_prompt_tokens=8))
    engine.validate(list(range(3, 11)), SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match=r"^input_ids: the prompt has 9 tokens, more than max_prompt_tokens \(8\)"):
        engine.validate(list(range(3, 12)), SamplingParams(max_tokens=2))
    assert EngineConfig.from_mapping({"max_prompt_tokens": "none"}).max_prompt_tokens is None
