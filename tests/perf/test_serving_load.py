"""perf/load/serving_load.py: the OpenAI streaming side against a loopback SSE server written here
(vLLM does not run on this machine), the Triton side against the real server, the closed and open
loops, and the summary on hand-made timings."""
from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.load import openai_stream, serving_load as sl  # noqa: E402


async def _sse_server(events_for, status=200, chunked=True):
    """A loopback HTTP/1.1 server answering every POST with the SSE events `events_for(body)`."""
    seen = []

    async def handle(reader, writer):
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += await reader.read(1)
        length = int([h for h in head.decode().split("\r\n") if h.lower().startswith("content-length")][0].split(":")[1])
        body = json.loads(await reader.readexactly(length))
        seen.append(body)
        te = "Transfer-Encoding: chunked\r\n" if chunked else ""
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: text/event-stream\r\n{te}\r\n".encode())
        for data in events_for(body):
            block = f"data: {data}\r\n\r\n".encode()
            writer.write(f"{len(block):x}\r\n".encode() + block + b"\r\n" if chunked else block)
            await writer.drain()
            await asyncio.sleep(0.01)
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


def _completion_events(body):
    n = body["max_tokens"]
    for i in range(n):
        yield json.dumps({"choices": [{"index": 0, "text": f" t{i}", "token_ids": [i], "finish_reason":
                                       "length" if i == n - 1 else None}]})
    yield json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
    yield "[DONE]"


def test_openai_stream_times_every_token_and_reads_usage():
    async def go():
        server, url, seen = await _sse_server(_completion_events)
        async with server:
            c = await openai_stream.stream_completion(url, {"model": "m", "prompt": "hi", "max_tokens": 5},
                                                      timeout_s=10)
            plain_server, plain_url, _ = await _sse_server(_completion_events, chunked=False)
            async with plain_server:
                p = await openai_stream.stream_completion(plain_url, {"model": "m", "prompt": "hi", "max_tokens": 2},
                                                          timeout_s=10)
        return c, p, seen

    c, p, seen = asyncio.run(go())
    assert c.output_tokens == 5 and c.content_tokens == (1,) * 5 and c.finish_reason == "length"
    assert c.text == " t0 t1 t2 t3 t4" and list(c.content_times) == sorted(c.content_times)
    assert c.sent_at < c.content_times[0] <= c.finished_at
    assert p.output_tokens == 2 and p.text == " t0 t1"
    assert seen[0]["prompt"] == "hi"


def test_openai_stream_errors_name_the_status():
    async def go(status, events):
        server, url, _ = await _sse_server(lambda b: events, status=status)
        async with server:
            return await openai_stream.stream_completion(url, {"model": "m", "prompt": "x", "max_tokens": 1},
                                                         timeout_s=10)

    with pytest.raises(openai_stream.HttpError, match="HTTP 400"):
        asyncio.run(go(400, ['{"error": {"message": "bad max_tokens"}}']))
    with pytest.raises(openai_stream.HttpError, match="without data: \\[DONE\\]"):
        asyncio.run(go(200, ['{"choices": [{"text": "a"}]}']))
    with pytest.raises(ValueError, match="url"):
        asyncio.run(openai_stream.stream_completion("https://x", {}, timeout_s=1))


def test_parse_events_keeps_the_incomplete_rest():
    events, rest = openai_stream.parse_events('data: {"a": 1}\r\n\r\ndata: [DONE]\n\ndata: {"b"')
    assert events == ['{"a": 1}', "[DONE]"] and rest == 'data: {"b"'


def test_summary_on_hand_made_timings():
    outs = [sl.Outcome(0, 0.0, 1.0, 3, (0.1, 0.2, 0.4), (1, 1, 2)),
            sl.Outcome(1, 0.5, 2.0, 2, (0.8, 1.0), (1, 1)),
            sl.Outcome(2, 0.5, 0.6, error="HttpError: HTTP 500")]
    s = sl.summarize(outs, expected_tokens=8)
    assert (s["requests"], s["done"], s["errors"], s["output_tokens"]) == (3, 2, 1, 5)
    assert s["window_s"] == 2.0 and s["tok_per_s"] == 2.5 and s["req_per_s"] == 1.0
    assert s["ttft_p50_ms"] == pytest.approx(200.0)                    # TTFTs 0.1 and 0.3
    assert s["itl_p50_ms"] == pytest.approx(100.0)                     # gaps 0.1, 0.2/2, 0.2
    assert s["e2e_p99_ms"] == pytest.approx(1495.0)
    assert sl.poisson_arrivals(4, float("inf"), 0) == [0.0] * 4
    a = sl.poisson_arrivals(200, 10.0, 1)
    assert a == sl.poisson_arrivals(200, 10.0, 1) and a[0] == 0.0 and 15 < a[-1] < 25


def test_sustained_rate_counts_the_tokens_between_the_first_and_the_last_send():
    # sends at 0, 1 and 2 s; tokens inside [0, 2]: 1 + 2 (request 0) + 1 (request 1); request 2's arrive
    # after the last send (the drain), the failed request's not at all
    outs = [sl.Outcome(0, 0.0, 1.0, 3, (0.5, 1.5), (1, 2)),
            sl.Outcome(1, 1.0, 3.0, 2, (1.9, 2.5), (1, 1)),
            sl.Outcome(2, 2.0, 9.0, 5, (2.1, 9.0), (1, 4)),
            sl.Outcome(3, 1.5, 1.6, error="HttpError: HTTP 500")]
    assert sl.sustained(outs) == (2.0, 2.0)
    s = sl.summarize(outs)
    assert s["sustained_tok_per_s"] == 2.0 and s["sustained_window_s"] == 2.0
    assert s["tok_per_s"] == pytest.approx(10 / 9)          # the whole run: its drain included
    assert sl.sustained(outs[:1]) == (0.0, None) and sl.sustained([replace(outs[0], index=1), outs[0]]) == (0.0, None)


def test_sustained_rate_is_none_when_every_request_was_sent_before_any_finished():
    # 3 requests at once (a closed loop as wide as the trace): the sends span 2 ms of ramp-up
    outs = [sl.Outcome(i, 0.001 * i, 5.0 + i, 4, (0.5, 1.0), (1, 3)) for i in range(3)]
    assert sl.sustained(outs) == (pytest.approx(0.002), None)
    assert sl.summarize(outs)["sustained_tok_per_s"] is None


def test_closed_loop_keeps_its_concurrency_and_open_loop_sends_on_time():
    in_flight, peak = 0, 0

    async def send(i, r):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        t0 = asyncio.get_running_loop().time()
        await asyncio.sleep(0.02)
        in_flight -= 1
        if r == "bad":
            raise RuntimeError("refused")
        return sl.Outcome(i, t0, t0 + 0.02, 1, (t0 + 0.01,), (1,))

    outs = asyncio.run(sl.closed_loop(send, ["a", "b", "bad", "c", "d"], 2))
    assert peak == 2 and [o.index for o in outs] == [0, 1, 2, 3, 4]
    assert outs[2].error == "RuntimeError: refused" and sum(o.error is None for o in outs) == 4
    peak = 0
    outs = asyncio.run(sl.open_loop(send, ["a"] * 6, [0.0] * 6))
    assert peak == 6 and len(outs) == 6


def test_openai_body_from_a_workload_line(tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"prompt": "one two", "max_tokens": 4, "min_tokens": 4, "ignore_eos": True}) + "\n"
                  + json.dumps({"input_ids": [5, 6, 7], "max_tokens": 9}) + "\n")
    reqs = sl.load_requests(wl, None, output_tokens=3)
    a, b = sl.openai_body(reqs[0], "m"), sl.openai_body(reqs[1], "m")
    assert a["prompt"] == "one two" and b["prompt"] == [5, 6, 7]
    assert a["max_tokens"] == a["min_tokens"] == b["max_tokens"] == b["min_tokens"] == 3
    assert a["ignore_eos"] and a["temperature"] == 0.0 and a["stream"] and a["return_token_ids"]
    t = sl.load_requests(None, 2, None, trace="seed-12x128")
    assert len(t) == 2 and len(t[0].input_ids) == 128 and t[0].max_tokens == t[0].min_tokens == 128
    assert sl.openai_body(t[0], "m")["prompt"] == list(t[0].input_ids)


def test_openai_target_end_to_end_through_main(tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 3}) + "\n" for i in range(4)))

    async def go():
        server, url, seen = await _sse_server(_completion_events)
        async with server:
            args = ["--target", "openai", "--url", url, "--model", "m", "--workload", str(wl), "--rate", "inf",
                    "--json", str(tmp_path / "o.json")]
            return await asyncio.to_thread(sl.main, args), seen

    rc, seen = asyncio.run(go())
    data = json.loads((tmp_path / "o.json").read_text())
    assert rc == 0 and len(seen) == 4 and data["summary"]["output_tokens"] == data["summary"]["expected_tokens"] == 12
    assert data["summary"]["loop"] == "open" and data["summary"]["ttft_p50_ms"] > 0


def test_triton_target_against_the_real_server(triton_server, tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text("".join(json.dumps({"prompt": f"Count to {i}.", "max_tokens": 4}) + "\n" for i in range(3)))
    out = tmp_path / "t.json"
    rc = sl.main(["--target", "triton", "--url", f"127.0.0.1:{triton_server.grpc_port}", "--model", "ensemble",
                  "--workload", str(wl), "--concurrency", "2", "--json", str(out)])
    s = json.loads(out.read_text())["summary"]
    assert rc == 0 and s["done"] == 3 and s["output_tokens"] == s["expected_tokens"] == 12
    assert s["ttft_p50_ms"] > 0 and s["itl_p50_ms"] is not None


def test_split_spreads_requests_and_concurrency_and_keeps_arrival_times():
    reqs = list("abcdefg")
    shares = sl.split(reqs, 3, 5, None)
    assert [s.indices for s in shares] == [(0, 3, 6), (1, 4), (2, 5)]
    assert [s.concurrency for s in shares] == [2, 2, 1] and shares[1].requests == ("b", "e")
    arrivals = [0.1 * i for i in range(7)]
    opened = sl.split(reqs, 2, None, arrivals, start_at=5.0)
    assert opened[1].arrivals == (0.1, 0.30000000000000004, 0.5) and opened[0].start_at == 5.0
    assert [len(s.indices) for s in sl.split(reqs[:2], 4, 8, None)] == [1, 1]   # empty shares dropped
    assert [s.concurrency for s in sl.split(reqs, 3, 1, None)] == [1, 1, 1]
    with pytest.raises(ValueError, match="processes"):
        sl.split(reqs, 0, 1, None)


def test_id_offset_shifts_a_trace_within_its_vocabulary():
    base = sl.load_requests(None, 3, None, trace="seed-12x128")
    moved = sl.load_requests(None, 3, None, trace="seed-12x128", id_offset=31_999)
    assert all(m == (b + 31_999) % 32_000 for r0, r1 in zip(base, moved) for b, m in zip(r0.input_ids, r1.input_ids))
    assert moved[0].input_ids != base[0].input_ids and max(max(r.input_ids) for r in moved) < 32_000


def test_two_client_processes_send_every_request_once(tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 2 + i % 3}) + "\n" for i in range(7)))

    async def go(loop_args):
        server, url, seen = await _sse_server(_completion_events)
        async with server:
            args = ["--target", "openai", "--url", url, "--model", "m", "--workload", str(wl), *loop_args,
                    "--processes", "2", "--json", str(tmp_path / "o.json")]
            return await asyncio.to_thread(sl.main, args), seen

    for loop_args in (["--concurrency", "3"], ["--rate", "50"]):
        rc, seen = asyncio.run(go(loop_args))
        data = json.loads((tmp_path / "o.json").read_text())
        assert rc == 0 and sorted(b["prompt"] for b in seen) == [f"p{i}" for i in range(7)]
        assert [r["index"] for r in data["requests"]] == list(range(7))
        assert data["summary"]["output_tokens"] == data["summary"]["expected_tokens"] == sum(2 + i % 3 for i in range(7))
        assert data["summary"]["processes"] == 2 and data["summary"]["window_s"] < 20
        assert len(data["summary"]["client_cpu_per_s"]) == 2 and all(b > 0 for b in data["summary"]["client_cpu_per_s"])
