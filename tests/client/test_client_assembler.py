import pytest

from kvshare_client.assembler import CompletionAssembler, check_finished_ok
from kvshare_client.errors import ProtocolError, ServerError
from kvshare_client.types import StreamChunk


def chunk(i, t, text="", ids=(), n=None, final=False, reason=None, nin=None, cached=None):
    return StreamChunk(
        index=i,
        text=text,
        token_ids=tuple(ids),
        finish_reason=reason,
        num_input_tokens=nin,
        num_output_tokens=n,
        cached_tokens=cached,
        is_final=final,
        received_at=t,
    )


def test_deltas_join_counts_sum_and_metadata_keeps_latest():
    a = CompletionAssembler("ensemble", "r1", sent_at=0.0)
    a.add(chunk(0, 0.2, "Hel", n=1, nin=6, cached=4))
    a.add(chunk(1, 0.3, "lo", n=2))
    a.add(chunk(2, 0.4, " world", n=1, reason="stop"))
    a.add(chunk(3, 0.45, final=True))
    assert a.done
    c = a.build()
    assert c.text == "Hello world" and c.num_output_tokens == 4 and c.output_tokens == 4
    assert (c.num_input_tokens, c.cached_tokens, c.finish_reason) == (6, 4, "stop")
    assert c.num_responses == 4
    assert c.content_times == (0.2, 0.3, 0.4)  # the empty final response is no token
    assert c.content_tokens == (1, 2, 1)
    assert c.ttft_s == pytest.approx(0.2) and c.e2e_s == pytest.approx(0.45)
    assert c.itl_s == pytest.approx(0.2 / 3)


def test_token_ids_accumulate_for_the_token_model():
    a = CompletionAssembler("llm_engine", "r", 0.0)
    a.add(chunk(0, 0.1, ids=[5, 6]))
    a.add(chunk(1, 0.2, ids=[7], final=True, reason="length"))
    c = a.build()
    assert c.token_ids == (5, 6, 7) and c.output_tokens == 3 and c.num_output_tokens is None


def test_response_after_the_final_one_is_a_protocol_error():
    a = CompletionAssembler("m", "r", 0.0)
    a.add(chunk(0, 0.1, "x", final=True))
    with pytest.raises(ProtocolError):
        a.add(chunk(1, 0.2, "y"))


def test_client_cancel_reports_cancelled_with_what_arrived():
    a = CompletionAssembler("m", "r", 0.0)
    a.add(chunk(0, 0.1, "par"))
    c = a.build(cancelled=True, finished_at=0.3)
    assert (c.text, c.finish_reason, c.cancelled, c.e2e_s) == ("par", "cancelled", True, 0.3)


def test_finish_reason_error_raises_server_error():
    a = CompletionAssembler("m", "r", 0.0)
    a.add(chunk(0, 0.1, final=True, reason="error"))
    with pytest.raises(ServerError, match="finish_reason=error"):
        check_finished_ok(a.build())
    ok = CompletionAssembler("m", "r", 0.0)
    ok.add(chunk(0, 0.1, "a", final=True, reason="length"))
    assert check_finished_ok(ok.build()).text == "a"
