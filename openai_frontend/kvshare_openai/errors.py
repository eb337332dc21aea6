"""OpenAI's error object, and the HTTP status each kind of failure maps to."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)         # not frozen: Starlette clears an exception's __traceback__
class ApiError(Exception):
    """Raised anywhere below the routes; the app turns it into `{"error": {...}}` with `status`."""
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def unsupported(param: str, why: str = "is not supported by kvshare") -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist (this server serves `{served}`)", param="model",
                    code="model_not_found")


# Triton's stream errors carry a message but no status code: overload is recognised by its words
# (kvshare's "llm_engine is overloaded: ... retry later", Triton's "queue is full" / "exceeds maximum
# queue size").
_OVERLOAD = ("overloaded", "queue is full", "maximum queue size", "retry later")


def from_server_message(message: str) -> ApiError:
    """A Triton error message as the HTTP error a client can act on."""
    lower = message.lower()
    if any(w in lower for w in _OVERLOAD):
        return ApiError(503, message, type="server_overloaded", code="overloaded")
    if "invalid_arg" in lower or ": " in message and not lower.startswith(("internal", "unavailable")):
        # kvshare's refusals start with the input's name ("temperature: must be >= 0")
        return ApiError(400, message, param=message.partition(":")[0].strip() or None)
    return ApiError(500, message, type="server_error")


def unavailable(message: str) -> ApiError:
    return ApiError(503, f"the Triton server is unavailable: {message}", type="server_unavailable",
                    code="unavailable")
