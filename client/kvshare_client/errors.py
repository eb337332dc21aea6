"""Exceptions of kvshare_client, and the mapping from what tritonclient / grpc raise.

Callers catch ``KvshareClientError``; the subclass says whose fault it is: the server rejected or
failed the request (``ServerError``, carrying the server's own message), the server could not be
reached (``ServerUnavailable``), or a response broke the wire contract (``ProtocolError``).
"""

from __future__ import annotations

from typing import Optional


class KvshareClientError(Exception):
    """Base class of every error this package raises on purpose."""


class ServerError(KvshareClientError):
    """The server answered with an error (e.g. INVALID_ARG naming the bad field)."""

    def __init__(
        self,
        message: str,
        *,
        status: Optional[str] = None,
        model: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> None:
        self.message = message
        self.status = status
        self.model = model
        self.request_id = request_id
        # The request id stays out of the text: load tests group failures by message, and a unique
        # id per request would make every failure its own group.
        where = f" [model={model}]" if model else ""
        code = f" ({status})" if status else ""
        super().__init__(f"server error{code}: {message}{where}")


class ServerUnavailable(KvshareClientError):
    """No connection to the server (wrong URL, server not started, network down)."""


class ProtocolError(KvshareClientError):
    """A response does not follow the wire contract (e.g. content after the final response)."""


class StreamTimeout(KvshareClientError):
    """The stream's deadline passed before the final response arrived."""


# grpc status codes arrive as strings such as "StatusCode.UNAVAILABLE" in tritonclient's
# InferenceServerException.status(); the raw stub gives grpc.StatusCode members. Normalise both.
def _status_name(status: object) -> Optional[str]:
    if status is None:
        return None
    name = getattr(status, "name", None) or str(status)
    return name.rsplit(".", 1)[-1] or None


def from_status(
    message: str,
    status: object = None,
    *,
    model: Optional[str] = None,
    request_id: Optional[str] = None,
) -> KvshareClientError:
    """Pick the exception for a server/transport error described by message and gRPC status."""
    name = _status_name(status)
    if name == "UNAVAILABLE":
        return ServerUnavailable(f"cannot reach the server: {message}")
    if name == "DEADLINE_EXCEEDED":
        return StreamTimeout(f"stream deadline exceeded: {message}")
    return ServerError(message, status=name, model=model, request_id=request_id)


def from_tritonclient(
    exc: BaseException, *, model: Optional[str] = None, request_id: Optional[str] = None
) -> KvshareClientError:
    """Map tritonclient's InferenceServerException (duck-typed: message()/status())."""
    message = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
    status = exc.status() if callable(getattr(exc, "status", None)) else None
    return from_status(message or str(exc), status, model=model, request_id=request_id)


def from_rpc_error(
    exc: BaseException, *, model: Optional[str] = None, request_id: Optional[str] = None
) -> KvshareClientError:
    """Map a grpc.RpcError (sync or aio; duck-typed: code()/details())."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    details = exc.details() if callable(getattr(exc, "details", None)) else None
    return from_status(details or str(exc), code, model=model, request_id=request_id)
