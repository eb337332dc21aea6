from hypothesis import given, strategies as st

from kvshare.engine.request_state import RequestState
from kvshare.sampling_params import SamplingParams


@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=20), output=st.lists(st.integers(0, 99), max_size=20),
       start=st.integers(0, 40), n=st.integers(1, 40))
def test_token_slice_equals_slicing_the_concatenation(prompt, output, start, n):
    s = RequestState("r", 0, prompt, SamplingParams(), None, None, output_ids=list(output))
    assert s.token_slice(start, n) == (prompt + output)[start:start + n]
