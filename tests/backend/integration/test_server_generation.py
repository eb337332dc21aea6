"""Text in, text streamed out through the real Triton server (ensemble -> preprocessing -> llm_engine)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvshare.runtime.tokenizer import default_model_source, encode_prompt
from kvshare_client import GenerationRequest, KvshareClient

pytestmark = pytest.mark.server

PLAIN = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
         "The three primary colors are"]
CHAT = ["What is the capital of France?", "Write a haiku about the ocean.", "Explain photosynthesis to a child.",
        "List three uses of a paperclip."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def client(triton_server):
    with KvshareClient(triton_server.grpc_url, stream_timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    src = default_model_source()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src),
                                                dtype=torch.float32).eval()


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("prompt,chat", [(p, False) for p in PLAIN] + [(p, True) for p in CHAT])
def test_greedy_stream_matches_hf_generate(client, hf_model, tokenizer, prompt, chat):
    req = GenerationRequest(prompt=prompt, apply_chat_template=chat, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                            temperature=0.0, stream=True, return_num_input_tokens=True)
    done = client.generate(req)
    ids = encode_prompt(tokenizer, prompt, chat=chat)
    assert done.num_input_tokens == len(ids)
    assert list(done.token_ids) == hf_greedy(hf_model, ids, NEW_TOKENS)
    assert done.text == tokenizer.decode(list(done.token_ids), skip_special_tokens=True)
    assert done.finish_reason == "length"
    assert done.num_responses > 1, "stream=true must stream"


def test_sixteen_concurrent_streams_equal_their_sequential_runs(client):
    prompts = [f"Tell me fact number {i} about {topic}." for i, topic in
               enumerate(["cats", "rivers", "stars", "bread", "trains", "music", "snow", "bees"] * 2)]
    prompts = [p if i < 8 else p.replace("fact", "a story") for i, p in enumerate(prompts)]
    reqs = [GenerationRequest(prompt=p, apply_chat_template=True, max_tokens=20, temperature=0.0, stream=True)
            for p in prompts]
    sequential = [client.generate(r) for r in reqs]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(client.generate, reqs))
    for seq, con in zip(sequential, concurrent):
        assert con.token_ids == seq.token_ids
        assert con.text == seq.text
        assert con.finish_reason == seq.finish_reason


def test_chinese_and_emoji_deltas_join_to_the_full_text(client, tokenizer):
    # SmolLM2 answers this with Chinese and a run of emoji; 40 tokens end inside an emoji's bytes.
    req = GenerationRequest(prompt="请用中文回答：你好吗？😊", apply_chat_template=True,
                            max_tokens=40, temperature=0.0, stream=True)
    chunks = list(client.stream(req))
    joined = "".join(c.text for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    assert joined == tokenizer.decode(ids, skip_special_tokens=True)
    # A character split across tokens is only sent once complete; only the very end of a cut-off
    # generation may hold the replacement character, exactly as the full decode does.
    assert all("\ufffd" not in c.text for c in chunks if not c.is_final)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in joined), joined
    assert any(ord(ch) >= 0x1F300 for ch in joined), joined


def test_non_streaming_sends_one_response_with_the_whole_text(client):
    req = GenerationRequest(prompt="The capital of France is", max_tokens=12, temperature=0.0, stream=False)
    done = client.generate(req)
    streamed = client.generate(GenerationRequest(prompt="The capital of France is", max_tokens=12, temperature=0.0,
                                                 stream=True))
    assert done.num_responses == 1
    assert done.text == streamed.text and done.token_ids == streamed.token_ids


def test_stop_word_spanning_tokens_is_never_emitted(client):
    base = GenerationRequest(prompt="Once upon a time, in a small village,", max_tokens=40, temperature=0.0, stream=True)
    full = client.generate(base).text
    words = full.split()
    stop = " ".join(words[4:6])          # two words: several tokens, so it spans responses
    assert stop and stop in full
    req = GenerationRequest(prompt=base.prompt, max_tokens=40, temperature=0.0, stream=True, stop_words=[stop])
    done = client.generate(req)
    assert done.finish_reason == "stop"
    assert done.text == full[: full.index(stop)]
    assert stop not in done.text


def test_same_seed_same_output(client):
    def run(seed: int):
        return client.generate(GenerationRequest(prompt="Write a sentence about the sea.", apply_chat_template=True,
                                                 max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=seed,
                                                 stream=True)).token_ids
    first = run(1234)
    assert run(1234) == first
    assert any(run(s) != first for s in (1, 2, 3))


def test_exclude_input_in_output_false_echoes_the_prompt_in_a_whole_answer_only(client):
    """As TensorRT-LLM: a non-streamed answer starts with the prompt; streamed deltas never carry it."""
    whole = client.generate(GenerationRequest(prompt="The capital of France is", max_tokens=8, temperature=0.0,
                                              stream=False, exclude_input_in_output=False))
    streamed = client.generate(GenerationRequest(prompt="The capital of France is", max_tokens=8, temperature=0.0,
                                                 stream=True, exclude_input_in_output=False))
    assert whole.text == "The capital of France is" + streamed.text
    assert not streamed.text.startswith("The capital of France is")


def test_min_tokens_and_max_tokens_bound_the_output(client):
    done = client.generate(GenerationRequest(prompt="Say hi.", apply_chat_template=True, max_tokens=30, min_tokens=30,
                                             temperature=0.0, stream=True, return_num_output_tokens=True))
    assert len(done.token_ids) == 30 and done.num_output_tokens == 30
    assert done.finish_reason == "length"
