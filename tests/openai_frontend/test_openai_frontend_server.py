"""The OpenAI endpoint against the real server, through the official `openai` SDK and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import http.client
import socket
from urllib.parse import urlsplit
import openai
import pytest

from server_helpers import pool_gauges, post, wait_for_idle_pool

pytestmark = pytest.mark.server

CHAT = [{"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}]


@pytest.fixture(scope="module")
def client(frontend):
    with openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_models_and_health(frontend, client):
    assert [m.id for m in client.models.list().data] == [frontend.model]
    with urllib.request.urlopen(frontend.root_url + "/health") as r:
        assert json.loads(r.read())["status"] == "ok"


def test_chat_whole_and_streamed_agree_and_count_the_multi_turn_template(frontend, client, tokenizer):
    whole = client.chat.completions.create(model=frontend.model, messages=CHAT, max_tokens=16, temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    expected_prompt = tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert whole.usage.prompt_tokens == len(expected_prompt)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=frontend.model, messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # the same prompt again: its pages were left in the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions_stop_and_logprobs(frontend, client):
    r = client.completions.create(model=frontend.model, prompt="Count: one, two,", max_tokens=8, temperature=0,
                                  stop=[" four"], logprobs=0)
    c = r.choices[0]
    assert c.text == " three," and c.finish_reason == "stop"
    assert c.logprobs.tokens == [" three", ","]
    assert len(c.logprobs.token_logprobs) == 2 and all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert c.logprobs.text_offset == [0, 6]

    chat = client.chat.completions.create(model=frontend.model, messages=CHAT[:2], max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(t.logprob <= 0 and bytes(t.bytes).decode() == t.token for t in content)


def test_n_two_with_exact_lengths_and_seed(frontend, client):
    kw = dict(model=frontend.model, messages=CHAT[:2], max_completion_tokens=7, temperature=1.0, seed=1234, n=2,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in a.choices)
    assert a.usage.completion_tokens == 14
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in b.choices] == [c.message.content for c in a.choices]

    streamed = list(client.completions.create(model=frontend.model, prompt="Once upon a time", max_tokens=5, n=2,
                                              temperature=0, stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    for ch in streamed:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts[0] == texts[1] and texts[0]          # greedy: the two forks agree
    assert streamed[-1].usage.completion_tokens == 10


def test_user_is_the_cache_salt(frontend, client):
    messages = [{"role": "user", "content": "Name three colours of the rainbow, a salted question."}]

    def cached(user: str) -> int:
        r = client.chat.completions.create(model=frontend.model, messages=messages, max_tokens=1, temperature=0,
                                           user=user)
        return r.usage.prompt_tokens_details.cached_tokens

    cached("alice")
    assert cached("bob") == 0          # another salt: not even the chat template's system prompt is shared
    assert cached("alice") > 0


def test_penalties_logit_bias_and_top_p_are_accepted(frontend, client, tokenizer):
    banned = tokenizer.encode(" three", add_special_tokens=False)
    assert len(banned) == 1
    r = client.completions.create(model=frontend.model, prompt="Count: one, two,", max_tokens=2, temperature=0,
                                  logit_bias={str(banned[0]): -100}, presence_penalty=0.5, frequency_penalty=0.5,
                                  top_p=0.9)
    assert not r.choices[0].text.startswith(" three")


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("top_logprobs", 3), ("response_format", {"type": "json_object"}),
                                         ("frobnicate", 1)])
def test_an_unsupported_field_is_a_400_naming_it(frontend, client, field, value):
    body = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=frontend.model, messages=CHAT[:2], max_tokens=2,
                                       extra_body={field: value, **body})
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == field and err["type"] == "invalid_request_error"
    assert field in err["message"]


def test_a_value_the_server_refuses_is_a_400_naming_it(frontend, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=frontend.model, prompt="hi", max_tokens=100_000)
    assert e.value.body["param"] == "max_tokens" and "context" in e.value.body["message"]


def test_an_unknown_model_is_a_404(frontend, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT[:2], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_curl_style_raw_bodies(frontend):
    status, ctype, text = post(frontend.base_url + "/chat/completions", {
        "model": frontend.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
        "temperature": 0})
    assert status == 200 and ctype.startswith("application/json")
    body = json.loads(text)
    assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0

    status, ctype, text = post(frontend.base_url + "/completions", {
        "model": frontend.model, "prompt": "Count: one, two,", "max_tokens": 3, "temperature": 0, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " three, four"
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)

    status, _, text = post(frontend.base_url + "/completions", {"model": frontend.model, "prompt": "x", "echo": True})
    assert status == 400 and json.loads(text)["error"]["param"] == "echo"
    status, _, text = post(frontend.base_url + "/completions", {"model": frontend.model, "prompt": [1, 2, 3]})
    assert status == 400 and json.loads(text)["error"]["param"] == "prompt"


def _open(frontend, path: str, body: dict) -> http.client.HTTPConnection:
    """A raw HTTP request left open, so the test decides when the client goes away."""
    u = urlsplit(frontend.root_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1" + path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn


def _disconnects(frontend) -> int:
    with urllib.request.urlopen(frontend.root_url + "/metrics") as m:
        for line in m.read().decode().splitlines():
            if line.startswith("kvshare_openai_client_disconnects_total "):
                return int(float(line.split()[1]))
    raise AssertionError("no disconnect counter")


def test_a_client_that_leaves_mid_stream_cancels_and_the_pages_return(frontend):
    wait_for_idle_pool(frontend.metrics_url)
    before = _disconnects(frontend)
    conn = _open(frontend, "/chat/completions", {
        "model": frontend.model, "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True})
    r = conn.getresponse()
    assert r.status == 200
    events = 0
    while events < 4:
        events += r.readline().startswith(b"data: ")
    assert pool_gauges(frontend.metrics_url)["kvshare_kv_pages_active"] > 0 or events
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    left_at = time.monotonic()
    # 4000 tokens take minutes on this CPU: idle within seconds means the engine was told
    wait_for_idle_pool(frontend.metrics_url, timeout_s=20)
    assert time.monotonic() - left_at < 20
    assert _disconnects_after(frontend, before) == before + 1


def _disconnects_after(frontend, before: int) -> int:
    """The frontend's disconnect count once it moved past before (or after 5 s)."""
    deadline = time.monotonic() + 5
    while _disconnects(frontend) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    return _disconnects(frontend)


def test_a_whole_request_whose_client_leaves_is_cancelled_too(frontend):
    wait_for_idle_pool(frontend.metrics_url)
    before = _disconnects(frontend)
    conn = _open(frontend, "/completions", {"model": frontend.model, "prompt": "Count to a thousand:",
                                            "max_tokens": 4000, "temperature": 0, "ignore_eos": True})
    time.sleep(2.0)            # generating, nothing sent back yet
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_for_idle_pool(frontend.metrics_url, timeout_s=20)
    assert _disconnects_after(frontend, before) == before + 1


def test_overload_is_a_503_with_the_servers_reason(frontend):
    wait_for_idle_pool(frontend.metrics_url)

    async def burst():
        async with openai.AsyncOpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0, timeout=120) as c:
            async def one():
                try:
                    await c.completions.create(model=frontend.model, prompt="Count to a thousand:", max_tokens=24,
                                               temperature=0, extra_body={"ignore_eos": True})
                    return "ok"
                except openai.APIStatusError as e:
                    return (e.status_code, e.body)
            return await asyncio.gather(*(one() for _ in range(10)))

    results = asyncio.run(burst())
    refused = [r for r in results if r != "ok"]
    assert refused and "ok" in results, results
    for status, body in refused:
        assert status == 503 and "overloaded" in body["message"] and body["code"] == "overloaded"
    wait_for_idle_pool(frontend.metrics_url)
