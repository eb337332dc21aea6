"""The soak's bookkeeping on its own: how outcomes are classified and how the pass criteria judge."""
from __future__ import annotations

import time

from kvshare_client.errors import ProtocolError, ServerError, StreamTimeout
from kvshare_client.types import Completion

from perf.load.soak import criteria
from perf.load.soak.outcomes import (BAD_INPUT, BURST, CANCEL, CANCELLED, COMPLETED, HUNG, KINDS, NON_STREAM,
                                     OVERLOADED, PROTOCOL, REJECTED, REJECTED_UNNAMED, SERVER_ERROR, STREAM,
                                     ACCEPTED_BAD_INPUT, WRONG_SHAPE, ClientCancel, Outcome, OutcomeLog,
                                     classify_completion, classify_error)

OVERLOAD = ("llm_engine is overloaded: 24 requests are already running or queued (max_queued_requests = 24); "
            "retry later")


def completion(finish_reason="length", content=3) -> Completion:
    return Completion(model="m", request_id="r", text="abc", token_ids=(), finish_reason=finish_reason,
                      num_input_tokens=4, num_output_tokens=content, cached_tokens=0, num_responses=content + 1,
                      sent_at=0.0, finished_at=1.0, content_times=tuple(0.1 * (i + 1) for i in range(content)))


def test_an_overload_refusal_is_expected_of_a_burst_and_during_one_only():
    err = ServerError(OVERLOAD)
    assert classify_error(BURST, err, field=None, gave_up=CANCELLED, overload_expected=False)[:2] == (OVERLOADED, True)
    assert classify_error(STREAM, err, field=None, gave_up=CANCELLED, overload_expected=True)[:2] == (OVERLOADED, True)
    assert classify_error(STREAM, err, field=None, gave_up=CANCELLED, overload_expected=False)[:2] == (OVERLOADED, False)


def test_a_bad_input_must_be_refused_naming_its_field():
    named = ServerError("top_p must be in (0, 1], got 1.5")
    assert classify_error(BAD_INPUT, named, field="top_p", gave_up=CANCELLED,
                          overload_expected=False)[:2] == (REJECTED, True)
    assert classify_error(BAD_INPUT, ServerError("invalid request"), field="top_p", gave_up=CANCELLED,
                          overload_expected=False)[:2] == (REJECTED_UNNAMED, False)
    assert classify_completion(BAD_INPUT, completion())[:2] == (ACCEPTED_BAD_INPUT, False)
    # The same refusal for a valid request is a server error.
    assert classify_error(STREAM, named, field=None, gave_up=CANCELLED, overload_expected=False)[:2] == \
        (SERVER_ERROR, False)


def test_hangs_protocol_breaks_and_error_finishes_are_never_expected():
    for kind in KINDS:
        assert classify_error(kind, StreamTimeout("deadline"), field=None, gave_up=CANCELLED,
                              overload_expected=True)[:2] == (HUNG, False)
        assert classify_error(kind, ProtocolError("after final"), field=None, gave_up=CANCELLED,
                              overload_expected=True)[:2] == (PROTOCOL, False)
    assert classify_completion(STREAM, completion(finish_reason="error"))[1] is False
    assert classify_completion(STREAM, completion(finish_reason="cancelled"))[1] is False


def test_a_client_cancel_is_expected_of_the_kinds_that_give_up():
    assert classify_error(CANCEL, ClientCancel(), field=None, gave_up=CANCELLED,
                          overload_expected=False)[:2] == (CANCELLED, True)
    assert classify_error(STREAM, ClientCancel(), field=None, gave_up=CANCELLED,
                          overload_expected=False)[1] is False


def test_a_non_streamed_answer_has_exactly_one_response_with_content():
    assert classify_completion(NON_STREAM, completion(content=1))[:2] == (COMPLETED, True)
    assert classify_completion(NON_STREAM, completion(content=2))[:2] == (WRONG_SHAPE, False)


def test_the_log_tallies_by_kind_and_keeps_burst_windows():
    log = OutcomeLog(overload_grace_s=5.0)
    now = time.time()
    assert not log.overload_expected(now)
    log.burst_started()
    assert log.overload_expected(now) and log.bursts_open == 1
    log.burst_ended(size=28, refused=4, hung=0)
    assert log.overload_expected(time.time()) and not log.overload_expected(time.time() + 6)
    log.record(Outcome(STREAM, "ensemble", COMPLETED, True, "", now, ttft_s=0.5))
    log.record(Outcome(STREAM, "llm_bls", SERVER_ERROR, False, "boom", now))
    totals = log.totals()
    assert totals["requests"] == 2 and totals["unexpected"] == 1
    assert totals["by_kind"][STREAM] == {COMPLETED: 1, SERVER_ERROR + " (UNEXPECTED)": 1}
    assert log.unexpected[0]["detail"] == "boom" and log.ttfts == [(now, 0.5)]


def test_percentiles_and_histogram_quantiles():
    assert criteria.percentile([], 0.99) is None
    assert criteria.percentile(list(range(1, 101)), 0.99) == 99
    assert criteria.percentile([3.0], 0.5) == 3.0
    start = {0.5: 10, 1.0: 10, 5.0: 10, float("inf"): 10}
    end = {0.5: 60, 1.0: 100, 5.0: 109, float("inf"): 110}   # 100 new: 50 <= 0.5 s, 40 <= 1 s, 9 <= 5 s, 1 above
    assert criteria.histogram_quantile(start, end, 0.5) == 0.5
    assert criteria.histogram_quantile(start, end, 0.9) == 1.0
    assert criteria.histogram_quantile(start, end, 0.99) == 5.0
    assert criteria.histogram_quantile(end, end, 0.5) is None


def test_rss_growth_compares_the_window_after_warm_up_with_the_last_one():
    rows = [{"elapsed_s": float(t), "rss_total_mb": 1000.0 + (400 if t < 10 else 0) + (t >= 90) * 60}
            for t in range(0, 101, 2)]
    g = criteria.rss_growth(rows, warmup_end_s=25, load_end_s=100, window_s=10)
    assert g == {"start_mb": 1000.0, "end_mb": 1060.0, "growth": 0.06}
    assert criteria.rss_growth(rows, warmup_end_s=200, load_end_s=100, window_s=10) is None


def test_evaluate_passes_only_when_every_criterion_holds():
    good = dict(unexpected=0, requests=50, bursts=[{"refused": 3, "hung": 0}], bursts_open=0,
                idle_gauges={"kv_pages_active": 0, "kv_pages_cached": 90, "kv_pages_free": 102, "kv_pages_total": 192},
                rss={"start_mb": 100.0, "end_mb": 101.0, "growth": 0.01}, rss_limit=0.05, ttft_p99_s=2.0,
                ttft_bound_s=60, alive=(True, "ok"), kinds_seen={k: 1 for k in KINDS}, kinds_required=KINDS)
    assert all(c.ok for c in criteria.evaluate(**good))
    bad = {
        "unexpected": 1,
        "bursts": [{"refused": 0, "hung": 0}],
        "idle_gauges": {"kv_pages_active": 0, "kv_pages_cached": 90, "kv_pages_free": 101, "kv_pages_total": 192},
        "rss": {"start_mb": 100.0, "end_mb": 106.0, "growth": 0.06},
        "ttft_p99_s": 61.0,
        "alive": (False, "gone"),
        "kinds_seen": {STREAM: 3},
    }
    for key, value in bad.items():
        failed = [c.name for c in criteria.evaluate(**{**good, key: value}) if not c.ok]
        assert len(failed) == 1, (key, failed)
    leaked = {"kv_pages_active": 2, "kv_pages_cached": 90, "kv_pages_free": 100, "kv_pages_total": 192}
    assert not criteria.pages_exact(leaked).ok
