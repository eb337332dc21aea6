"""server_cpu_threads / server_step_threads: the CPU engine's torch threads inside the server (decode
steps take both cores of a 2-core machine and leave one to the server on a larger one, steps with a
prompt take every core by default;
KVSHARE_CPU_THREADS, KVSHARE_CPU_PREFILL_THREADS or OMP_NUM_THREADS decide otherwise; a bad value
is refused by name)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvshare.runtime.step_threads import StepThreads
from kvshare.triton_adapter.cpu_threads import cores, default_decode_threads, server_cpu_threads, server_step_threads


@given(st.integers(1, 512))
def test_the_default_leaves_one_core_above_two(available):
    want = available if available <= 2 else available - 1
    assert server_cpu_threads({}, available) == want == default_decode_threads(available)
    assert server_cpu_threads({"KVSHARE_CPU_THREADS": "0"}, available) == want
    assert server_cpu_threads({}, 2) == 2 and server_cpu_threads({}, 3) == 2


@given(st.integers(1, 512), st.integers(1, 512))
def test_an_explicit_count_wins_over_omp_num_threads(available, n):
    assert server_cpu_threads({"KVSHARE_CPU_THREADS": f" {n} ", "OMP_NUM_THREADS": "3"}, available) == n


def test_omp_num_threads_leaves_torch_its_choice():
    assert server_cpu_threads({"OMP_NUM_THREADS": "2"}, 8) is None


def not_an_int(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return True
    return False


@given(st.text(min_size=1).filter(lambda s: s.strip() and not_an_int(s.strip())))
def test_a_non_number_is_refused_by_name(raw):
    with pytest.raises(ValueError, match="KVSHARE_CPU_THREADS must be a whole number"):
        server_cpu_threads({"KVSHARE_CPU_THREADS": raw}, 4)


def test_a_negative_count_is_refused_by_name():
    with pytest.raises(ValueError, match="KVSHARE_CPU_THREADS must be >= 0"):
        server_cpu_threads({"KVSHARE_CPU_THREADS": "-2"}, 4)


def test_cores_counts_this_process():
    assert cores() >= 1


@given(st.integers(1, 512))
def test_prompt_steps_take_every_core_by_default(available):
    want = StepThreads(decode=default_decode_threads(available), prefill=available)
    assert server_step_threads({}, available) == want


@given(st.integers(1, 512), st.integers(0, 512), st.integers(0, 512))
def test_explicit_counts_set_each_kind(available, decode, prefill):
    env = {"KVSHARE_CPU_THREADS": str(decode), "KVSHARE_CPU_PREFILL_THREADS": str(prefill), "OMP_NUM_THREADS": "3"}
    assert server_step_threads(env, available) == StepThreads(decode=decode or default_decode_threads(available),
                                                              prefill=prefill or available)


def test_omp_num_threads_alone_leaves_both_counts_to_torch():
    assert server_step_threads({"OMP_NUM_THREADS": "2"}, 8) is None
    assert server_step_threads({"OMP_NUM_THREADS": "2", "KVSHARE_CPU_PREFILL_THREADS": "4"}, 8) == \
        StepThreads(decode=8, prefill=4)


@pytest.mark.parametrize("raw, message", [("two", "a whole number"), ("-1", ">= 0")])
def test_a_bad_prefill_count_is_refused_by_name(raw, message):
    with pytest.raises(ValueError, match=f"KVSHARE_CPU_PREFILL_THREADS must be {message}"):
        server_step_threads({"KVSHARE_CPU_PREFILL_THREADS": raw}, 4)
