"""ResponsePump without a server: per-step batches, stream_interval, the one final response, and the
reused response tensors (a fake pb_utils that records what each response carried when it was sent)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvshare.engine.outputs import RequestOutput
from kvshare.sampling_params import SamplingParams
from kvshare.triton_adapter.inputs import GenerationRequest
from kvshare.triton_adapter.response_stream import (
    ClientStream,
    ResponseBuilder,
    ResponsePump,
    build_response,
)

FINAL = 2


class FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.array(array, copy=True)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class FakeResponse:
    def __init__(self, output_tensors=(), error=None):
        self.output_tensors, self.error = list(output_tensors), error


class FakeError:
    INVALID_ARG, INTERNAL, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "UNAVAILABLE"

    def __init__(self, message, code=None):
        self.message, self.code = message, code


class FakePb:
    Tensor = FakeTensor
    InferenceResponse = FakeResponse
    TritonError = FakeError
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL


class Sent:
    """What a client received in one response, read at send() time as Triton copies it."""

    def __init__(self, response: FakeResponse | None, flags: int):
        self.flags = flags
        self.bare = response is None          # flags only, as a request is closed without a response
        tensors = response.output_tensors if response is not None else []
        self.error = response.error if response is not None else None
        self.tensors = {t.name(): t.as_numpy().copy() for t in tensors}
        self.tensor_ids = {t.name(): id(t) for t in tensors}

    @property
    def final(self) -> bool:
        return self.flags == FINAL

    @property
    def ids(self) -> list[int]:
        return self.tensors["output_ids"].reshape(-1).tolist()

    @property
    def text(self) -> str:
        return self.tensors["text_output"].reshape(-1)[0].decode()

    @property
    def finish_reason(self) -> str:
        return self.tensors["finish_reason"].reshape(-1)[0].decode()


class FakeSender:
    def __init__(self, fail: bool = False):
        self.sent: list[Sent] = []
        self.done = threading.Event()
        self.fail = fail

    def send(self, response=None, flags=0):
        if self.fail:
            raise RuntimeError("the client went away")
        self.sent.append(Sent(response, flags))
        if flags == FINAL:
            self.done.set()


def request(stream=True, num_in=False, num_out=False) -> GenerationRequest:
    return GenerationRequest([1, 2, 3], SamplingParams(max_tokens=64), stream, True, num_in, num_out, "")


def out(rid, ids, text="", finished=False, reason=None, cached=0, n_out=0, error=None) -> RequestOutput:
    return RequestOutput(rid, tuple(ids), text, finished, reason, 3, n_out, cached, error)


class Harness:
    """Feeds the pump one step at a time and waits until it has handled each step, so that what is
    held back and what is sent is deterministic (a finished probe request closes every batch)."""

    def __init__(self, interval: int = 1):
        self.pump = ResponsePump(FakePb, stream_interval=interval)
        self._probes = 0

    def add(self, rid, req=None, sender=None, requested=frozenset()) -> FakeSender:
        sender = sender or FakeSender()
        self.pump.register(rid, ClientStream(sender, req or request(), requested=requested))
        return sender

    def step(self, outputs: list[RequestOutput]) -> None:
        self._probes += 1
        rid = f"probe-{self._probes}"
        probe = self.add(rid)
        self.pump.put_many(outputs + [out(rid, [0], finished=True, reason="length")])
        assert probe.done.wait(10), "the pump did not handle the step"

    def close(self):
        self.pump.close()


@pytest.fixture
def harness_factory():
    made: list[Harness] = []

    def make(interval: int = 1) -> Harness:
        h = Harness(interval)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def run_tokens(h: Harness, rid: str, n: int, *, text=lambda i: f"t{i} ") -> None:
    for i in range(n - 1):
        h.step([out(rid, [100 + i], text(i), n_out=i + 1)])
    h.step([out(rid, [100 + n - 1], text(n - 1), finished=True, reason="length", n_out=n)])


def test_every_token_is_a_response_at_interval_one(harness_factory):
    h = harness_factory(1)
    s = h.add("a")
    run_tokens(h, "a", 5)
    assert [r.ids for r in s.sent] == [[100], [101], [102], [103], [104]]
    assert [r.final for r in s.sent] == [False] * 4 + [True]
    assert "".join(r.text for r in s.sent) == "t0 t1 t2 t3 t4 "


@pytest.mark.parametrize("interval", [2, 3, 4, 16])
def test_stream_interval_sends_the_first_delta_at_once_then_every_n_tokens(harness_factory, interval):
    h = harness_factory(interval)
    s = h.add("a")
    n = 11
    run_tokens(h, "a", n)
    sizes = [len(r.ids) for r in s.sent]
    assert sizes[0] == 1, "the first token is never held back"
    assert all(k == interval for k in sizes[1:-1])
    assert 1 <= sizes[-1] <= interval and s.sent[-1].final
    assert sum(sizes) == n and [i for r in s.sent for i in r.ids] == list(range(100, 100 + n))
    assert "".join(r.text for r in s.sent) == "".join(f"t{i} " for i in range(n))
    assert sum(r.final for r in s.sent) == 1


def test_one_step_batch_reaches_every_stream_and_keeps_each_order(harness_factory):
    h = harness_factory(1)
    senders = {rid: h.add(rid) for rid in "abc"}
    for i in range(3):
        h.step([out(rid, [i], f"{rid}{i}", finished=(i == 2), reason="length" if i == 2 else None) for rid in "abc"])
    for rid, s in senders.items():
        assert [r.ids for r in s.sent] == [[0], [1], [2]] and s.sent[-1].final
        assert "".join(r.text for r in s.sent) == f"{rid}0{rid}1{rid}2"


def test_a_batch_holding_several_steps_of_a_request_goes_out_as_one_response(harness_factory):
    h = harness_factory(1)
    s = h.add("a")
    h.step([out("a", [1], "x"), out("a", [2], "y"), out("a", [3], "z")])
    assert [r.ids for r in s.sent] == [[1, 2, 3]] and s.sent[0].text == "xyz" and not s.sent[0].final


def test_held_deltas_join_the_cancelled_final(harness_factory):
    h = harness_factory(8)
    s = h.add("a")
    for i in range(4):
        h.step([out("a", [i], str(i))])
    h.step([out("a", [], "", finished=True, reason="cancelled")])
    assert [r.ids for r in s.sent] == [[0], [1, 2, 3]]
    assert s.sent[-1].final and s.sent[-1].finish_reason == "cancelled" and s.sent[-1].text == "123"


def test_a_non_streaming_request_gets_one_response_with_everything(harness_factory):
    h = harness_factory(1)
    s = h.add("a", request(stream=False))
    run_tokens(h, "a", 6)
    assert len(s.sent) == 1 and s.sent[0].final
    assert s.sent[0].ids == list(range(100, 106)) and s.sent[0].text == "".join(f"t{i} " for i in range(6))


def test_a_response_carries_only_the_outputs_its_client_asked_for(harness_factory):
    """Triton 2.51 drops unrequested tensors inside send() without the GIL, which corrupts the stub's
    allocator (response_stream.only_requested): none may reach send()."""
    h = harness_factory(1)
    s = h.add("a", request(num_in=True, num_out=True), requested=frozenset({"output_ids", "finish_reason"}))
    every = h.add("b", request(num_in=True, num_out=True))
    run_tokens(h, "a", 3)
    run_tokens(h, "b", 3)
    assert [set(r.tensors) for r in s.sent] == [{"output_ids", "finish_reason"}] * 3
    assert all({"text_output", "cached_tokens", "num_input_tokens", "num_output_tokens"} <= set(r.tensors)
               for r in every.sent)


def test_an_error_ends_the_stream_with_an_error_response(harness_factory):
    h = harness_factory(4)
    s = h.add("a")
    h.step([out("a", [1], "x")])
    h.step([out("a", [], "", finished=True, reason="error", error="device lost")])
    assert len(s.sent) == 2 and s.sent[-1].final
    assert s.sent[-1].error.message == "device lost" and s.sent[-1].error.code == "INTERNAL"


def test_a_sender_that_fails_does_not_stop_the_pump(harness_factory):
    h = harness_factory(1)
    h.add("gone", sender=FakeSender(fail=True))
    s = h.add("ok")
    h.step([out("gone", [1]), out("ok", [1])])
    h.step([out("gone", [2], finished=True, reason="length"), out("ok", [2], finished=True, reason="length")])
    assert [r.ids for r in s.sent] == [[1], [2]]


def test_outputs_of_unknown_or_forgotten_requests_are_dropped(harness_factory):
    h = harness_factory(1)
    s = h.add("a")
    h.pump.forget("a")
    h.step([out("a", [1], finished=True, reason="length"), out("nobody", [1])])
    assert s.sent == []


def test_reused_tensors_carry_each_response_s_own_values(harness_factory):
    h = harness_factory(1)
    a = h.add("a", request(num_in=True, num_out=True))
    b = h.add("b", request(num_in=True, num_out=True))
    for i in range(3):
        last = i == 2
        h.step([out("a", [10 + i], "", finished=last, reason="length" if last else None, cached=16),
                out("b", [20 + i, 30 + i], "é" if i == 1 else "", finished=last, reason="stop" if last else None,
                    cached=0)])
    assert [r.tensors["cached_tokens"].tolist() for r in a.sent] == [[[16]]] * 3
    assert [r.tensors["cached_tokens"].tolist() for r in b.sent] == [[[0]]] * 3
    assert [r.tensors["num_input_tokens"].tolist() for r in a.sent + b.sent] == [[[3]]] * 6
    assert [r.tensors["num_output_tokens"].tolist() for r in a.sent] == [[[1]]] * 3
    assert [r.tensors["num_output_tokens"].tolist() for r in b.sent] == [[[2]]] * 3
    assert [r.finish_reason for r in a.sent] == ["", "", "length"]
    assert [r.finish_reason for r in b.sent] == ["", "", "stop"]
    assert [r.text for r in b.sent] == ["", "é", ""]
    assert [r.ids for r in b.sent] == [[20, 30], [21, 31], [22, 32]]
    assert a.sent[0].tensors["output_ids"].dtype == np.int32 and a.sent[0].tensors["output_ids"].shape == (1, 1)
    # The empty finish_reason and the empty text are one tensor each across every response.
    assert len({r.tensor_ids["finish_reason"] for r in a.sent[:2] + b.sent[:2]}) == 1
    assert len({r.tensor_ids["text_output"] for r in a.sent}) == 1


def test_builder_equals_a_fresh_build():
    builder = ResponseBuilder(FakePb)
    req = request(num_in=True, num_out=True)
    for o in [out("a", [5, 6], "hi", cached=32), out("a", [], "", finished=True, reason="cancelled", cached=32),
              out("a", [7], "", cached=0)]:
        for _ in range(2):   # the second time from the cache
            got = {t.name(): t.as_numpy() for t in builder.response(o, req).output_tensors}
            want = {t.name(): t.as_numpy() for t in build_response(FakePb, o, req).output_tensors}
            assert got.keys() == want.keys()
            for name, value in got.items():
                assert value.dtype == want[name].dtype and value.tolist() == want[name].tolist(), name


def test_builder_int_cache_stays_bounded():
    builder = ResponseBuilder(FakePb)
    req = request()
    for cached in range(3 * ResponseBuilder._MAX_CACHED_INTS):
        builder.response(out("a", [1], cached=cached), req)
    assert len(builder._ints) <= ResponseBuilder._MAX_CACHED_INTS


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        ResponsePump(FakePb, stream_interval=0)


def test_put_one_output_still_works(harness_factory):
    h = harness_factory(1)
    s = h.add("a")
    h.pump.put(out("a", [1], "x", finished=True, reason="length"))
    assert s.done.wait(10) and [r.ids for r in s.sent] == [[1]]
