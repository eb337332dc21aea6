import grpc
import pytest
from tritonclient.utils import InferenceServerException

from kvshare_client.errors import (
    KvshareClientError,
    ServerError,
    ServerUnavailable,
    StreamTimeout,
    from_rpc_error,
    from_status,
    from_tritonclient,
)


def test_server_message_is_kept_verbatim_and_named():
    exc = from_tritonclient(
        InferenceServerException("max_tokens must be > 0, got 0"), model="ensemble", request_id="r7"
    )
    assert isinstance(exc, ServerError) and isinstance(exc, KvshareClientError)
    assert exc.message == "max_tokens must be > 0, got 0"
    assert "max_tokens must be > 0" in str(exc) and "ensemble" in str(exc)
    assert exc.request_id == "r7" and "r7" not in str(exc)  # ids would split load-test error groups


@pytest.mark.parametrize(
    "status, kind",
    [
        ("StatusCode.UNAVAILABLE", ServerUnavailable),
        ("StatusCode.DEADLINE_EXCEEDED", StreamTimeout),
        ("StatusCode.INVALID_ARGUMENT", ServerError),
        (None, ServerError),
    ],
)
def test_tritonclient_status_mapping(status, kind):
    assert type(from_tritonclient(InferenceServerException("boom", status=status))) is kind


def test_invalid_argument_status_is_visible():
    exc = from_status("bad top_p", grpc.StatusCode.INVALID_ARGUMENT)
    assert isinstance(exc, ServerError) and exc.status == "INVALID_ARGUMENT" and "INVALID_ARGUMENT" in str(exc)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_raw_grpc_errors_map_the_same_way():
    assert isinstance(
        from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")), ServerUnavailable
    )
    e = from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "engine died"), model="llm_engine")
    assert isinstance(e, ServerError) and e.message == "engine died" and e.status == "INTERNAL"
