"""server_cpu_threads: the CPU engine's torch threads inside the server (one core left to the server by
default; KVSHARE_CPU_THREADS or OMP_NUM_THREADS decide otherwise; a bad value is refused by name)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvshare.triton_adapter.cpu_threads import cores, server_cpu_threads


@given(st.integers(1, 512))
def test_the_default_leaves_one_core_and_keeps_at_least_one(available):
    assert server_cpu_threads({}, available) == max(1, available - 1)
    assert server_cpu_threads({"KVSHARE_CPU_THREADS": "0"}, available) == max(1, available - 1)


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


@given(st.text(min_size=1).filter(lambda s: s.strip() and not_an_int(s)))
def test_a_non_number_is_refused_by_name(raw):
    with pytest.raises(ValueError, match="KVSHARE_CPU_THREADS must be a whole number"):
        server_cpu_threads({"KVSHARE_CPU_THREADS": raw}, 4)


def test_a_negative_count_is_refused_by_name():
    with pytest.raises(ValueError, match="KVSHARE_CPU_THREADS must be >= 0"):
        server_cpu_threads({"KVSHARE_CPU_THREADS": "-2"}, 4)


def test_cores_counts_this_process():
    assert cores() >= 1
