"""The response pump when a response fails (fake pb_utils): a response that cannot be built (the
`pump` fault of engine/faults.py, or a bug) or sent still ends its Triton request with exactly one
error final, and the engine is asked to end the request so its pages return; other streams go on."""
from __future__ import annotations

from test_response_pump_batching import FakePb, FakeSender, out, request

from kvshare.engine.faults import FaultInjector, FaultSpec
from kvshare.triton_adapter.response_stream import ClientStream, Reply, ResponsePump


class Recorder:
    def __init__(self, faults: str = ""):
        self.abandoned: list[str] = []
        spec = FaultSpec.parse(faults)
        self.pump = ResponsePump(FakePb, on_abandoned=self.abandoned.append,
                                 faults=FaultInjector(spec) if spec.active else None)
        self._probes = 0

    def add(self, rid, sender=None, reply=None, req=None) -> FakeSender:
        sender = sender or FakeSender()
        self.pump.register(rid, ClientStream(sender, req or request(), reply=reply))
        return sender

    def step(self, outputs) -> None:
        self._probes += 1
        rid = f"probe-{self._probes}"
        probe = FakeSender()
        self.pump.register(rid, ClientStream(probe, request()))
        self.pump.put_many(outputs + [out(rid, [0], finished=True, reason="length")])
        assert probe.done.wait(10), "the pump did not handle the step"


def finals(sender: FakeSender) -> list:
    return [r for r in sender.sent if r.final]


def test_a_response_that_fails_to_build_ends_the_request_with_one_error_and_abandons_it():
    r = Recorder("pump:1:1")
    try:
        a = r.add("a")
        b = r.add("b")
        r.step([out("a", [1], "x"), out("b", [1], "y")])      # the first build fails: a's
        r.step([out("a", [2], "x"), out("b", [2], "y", finished=True, reason="length")])
        r.step([out("a", [], "", finished=True, reason="cancelled")])   # the engine's answer to the abandon
    finally:
        r.pump.close()
    assert len(a.sent) == 1 and a.sent[0].final and a.sent[0].error.code == "INTERNAL"
    assert "injected pump fault" in a.sent[0].error.message
    assert r.abandoned == ["a"]
    assert [s.ids for s in b.sent] == [[1], [2]] and len(finals(b)) == 1 and finals(b)[0].error is None


def test_a_final_that_fails_to_build_still_ends_the_request_and_abandons_nothing():
    r = Recorder("pump:1:1")
    try:
        a = r.add("a")
        r.step([out("a", [1], "x", finished=True, reason="length")])
    finally:
        r.pump.close()
    assert len(a.sent) == 1 and a.sent[0].final and a.sent[0].error is not None
    assert r.abandoned == [], "the engine already ended it"


def test_a_failed_send_abandons_the_request_and_tries_an_error_final():
    class FailsOnce(FakeSender):
        def send(self, response=None, flags=0):
            if not self.sent and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("the stub refused")
            super().send(response, flags)

    r = Recorder()
    try:
        a = r.add("a", sender=FailsOnce())
        r.step([out("a", [1], "x")])
        r.step([out("a", [2], "x")])      # dropped: the request is abandoned
    finally:
        r.pump.close()
    assert r.abandoned == ["a"]
    assert len(a.sent) == 1 and a.sent[0].final and a.sent[0].error.message == "the response could not be sent"


def test_a_final_that_fails_to_send_still_closes_the_request_with_a_bare_final(caplog):
    caplog.set_level("INFO", logger="kvshare.triton")
    class RefusesResponses(FakeSender):
        def send(self, response=None, flags=0):
            if response is not None and flags:
                raise RuntimeError("the stub refused")
            super().send(response, flags)

    r = Recorder()
    try:
        a = r.add("a", sender=RefusesResponses())
        r.step([out("a", [1], "x")])
        r.step([out("a", [2], "x", finished=True, reason="cancelled")])
    finally:
        r.pump.close()
    assert [s.ids for s in a.sent[:1]] == [[1]]
    assert len(a.sent) == 2 and a.sent[1].final and a.sent[1].bare, "the factory must be released"
    assert r.abandoned == [], "the engine already ended it"
    assert any("could not send the final response of request a" in m for m in caplog.messages)


def test_a_failure_in_one_member_of_a_batched_request_ends_the_whole_request_once():
    r = Recorder("pump:1:1")
    reply = Reply(open=2)
    try:
        sender = FakeSender()
        r.add("k/0.0", sender=sender, reply=reply)
        r.add("k/1.0", sender=sender, reply=reply)
        r.step([out("k/0.0", [1], "x")])       # fails: the whole Triton request ends here
        r.step([out("k/0.0", [2], "x", finished=True, reason="length"),
                out("k/1.0", [5], "z", finished=True, reason="length")])
    finally:
        r.pump.close()
    assert len(sender.sent) == 1 and sender.sent[0].final and sender.sent[0].error is not None
    assert sorted(r.abandoned) == ["k/0.0", "k/1.0"]


def test_without_the_switch_nothing_is_injected():
    r = Recorder("")
    try:
        assert r.pump._faults is None
        a = r.add("a")
        r.step([out("a", [1], "x", finished=True, reason="length")])
    finally:
        r.pump.close()
    assert len(a.sent) == 1 and a.sent[0].error is None and r.abandoned == []


def test_serve_to_the_end_closes_a_request_whose_backstop_error_cannot_go_out(caplog):
    """serve() failed before any final, and the stub refuses the INTERNAL error final too: the
    request still gets a bare final, so its response factory is released."""
    import logging

    from kvshare.triton_adapter.response_stream import serve_to_the_end

    class RefusesResponses(FakeSender):
        def send(self, response=None, flags=0):
            if response is not None:
                raise RuntimeError("the stub refused")
            super().send(response, flags)

    from kvshare.triton_adapter.request_snapshot import RequestSnapshot

    sender = RefusesResponses()

    def serve(request, tracked):
        raise ValueError("a bug before the first response")

    caplog.set_level("INFO", logger="kvshare.triton")
    serve_to_the_end(FakePb, "llm_engine", RequestSnapshot(sender, {}, "{}", "r1"), serve,
                     logging.getLogger("kvshare.triton"))
    assert len(sender.sent) == 1 and sender.sent[0].final and sender.sent[0].bare
    assert any("backstop final response could not be sent" in m for m in caplog.messages)
