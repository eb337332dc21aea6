"""request_snapshot: a worker thread gets copies of a request's inputs, read on the stub's thread."""
from __future__ import annotations

import numpy as np
import pytest

from kvshare.triton_adapter.request_snapshot import snapshot_request


class _Tensor:
    def __init__(self, name, array=None, error=None):
        self._name, self._array, self._error = name, array, error

    def name(self):
        return self._name

    def as_numpy(self):
        if self._error is not None:
            raise self._error
        return self._array


class _Request:
    def __init__(self, tensors, requested=()):
        self._tensors = tensors
        self._requested = list(requested)

    def requested_output_names(self):
        return self._requested

    def inputs(self):
        return self._tensors

    def get_response_sender(self):
        return "sender"

    def parameters(self):
        return '{"a": 1}'

    def request_id(self):
        return "id-7"


def test_numeric_inputs_are_copied_and_text_kept():
    shared = np.array([[1, 2, 3]], dtype=np.int32)      # as if a view of the request's memory
    text = np.array([b"hello"], dtype=np.object_)
    snap = snapshot_request(_Request([_Tensor("input_ids", shared), _Tensor("text_input", text)]))
    shared[0, 0] = 99                                    # the request's memory reused after execute()
    assert snap.get("input_ids").tolist() == [[1, 2, 3]]
    assert snap.get("text_input").tolist() == [b"hello"]
    assert snap.get("absent") is None
    assert (snap.sender, snap.parameters, snap.request_id) == ("sender", '{"a": 1}', "id-7")


def test_an_unreadable_input_raises_where_the_worker_reads_it():
    snap = snapshot_request(_Request([_Tensor("text_input", error=ValueError("bad bytes")),
                                      _Tensor("stream", np.array([True]))]))
    assert snap.get("stream").tolist() == [True]
    with pytest.raises(ValueError, match="bad bytes"):
        snap.get("text_input")


def test_the_outputs_the_client_asked_for_are_kept():
    snap = snapshot_request(_Request([], requested=["text_output", "finish_reason"]))
    assert snap.requested_outputs == frozenset({"text_output", "finish_reason"})
    assert snapshot_request(_Request([])).requested_outputs == frozenset()
