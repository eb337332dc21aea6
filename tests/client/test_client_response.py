from hypothesis import given
from hypothesis import strategies as st

from client_fakes import result
from kvshare_client.response import ChunkParser, is_final


def test_parses_every_contract_output():
    chunk = ChunkParser().parse(
        result(
            text="Paris".encode(),
            ids=[7, 8],
            finish_reason="stop",
            num_input_tokens=12,
            num_output_tokens=2,
            cached_tokens=8,
            final=True,
        ),
        received_at=1.5,
    )
    assert (chunk.text, chunk.token_ids, chunk.finish_reason) == ("Paris", (7, 8), "stop")
    assert (chunk.num_input_tokens, chunk.num_output_tokens, chunk.cached_tokens) == (12, 2, 8)
    assert chunk.is_final and chunk.received_at == 1.5 and chunk.index == 0 and chunk.has_content


def test_absent_outputs_are_none_and_empty_final_response_has_no_content():
    chunk = ChunkParser().parse(result(final=True), received_at=0.0)
    assert chunk.text == "" and chunk.token_ids == () and chunk.finish_reason is None
    assert chunk.num_output_tokens is None and chunk.cached_tokens is None
    assert chunk.is_final and not chunk.has_content


def test_empty_finish_reason_means_none():
    assert ChunkParser().parse(result(text=b"a", finish_reason=""), 0.0).finish_reason is None


def test_final_flag_is_read_from_the_response_parameter():
    assert not is_final(result(text=b"a"))
    assert is_final(result(text=b"a", final=True))


def test_indices_count_responses_in_order():
    p = ChunkParser()
    assert [p.parse(result(text=b"x"), 0.0).index for _ in range(3)] == [0, 1, 2]


def test_multibyte_character_split_across_responses_is_not_mangled():
    emoji = "🙂".encode("utf-8")
    p = ChunkParser()
    a = p.parse(result(text=b"ok " + emoji[:2]), 0.0)
    b = p.parse(result(text=emoji[2:] + b" done", final=True), 0.0)
    assert a.text + b.text == "ok 🙂 done"
    assert "\ufffd" not in a.text + b.text


def test_truncated_character_at_the_end_becomes_replacement_not_an_exception():
    p = ChunkParser()
    assert p.parse(result(text="é".encode()[:1], final=True), 0.0).text == "\ufffd"


@given(st.text(max_size=40), st.lists(st.integers(min_value=0, max_value=200), max_size=6))
def test_joined_deltas_equal_the_text_for_any_byte_split(text, cuts):
    data = text.encode("utf-8")
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0] + points, points + [len(data)])]
    p = ChunkParser()
    out = [p.parse(result(text=piece, final=i == len(pieces) - 1), 0.0).text for i, piece in enumerate(pieces)]
    assert "".join(out) == text
