"""Does the Triton server still serve this model? The engine loop asks every 0.5 s, so that a shutdown
or an unload ends the requests in flight at once (Triton 2.51 finalizes a decoupled model only
after every one of them has ended, and does not end them itself).

The question goes to the server's own HTTP endpoint (`GET /v2/models/<name>/ready`), found on the
command line of the stub's parent, tritonserver. It never goes through the stub's IPC: in Triton
2.51 `pb_utils.is_model_ready` segfaulted the stub about once in six shutdowns when the call met
the server's "unloading models" (docs/operate/troubleshoot.md), and the stub's death then held the server
past its exit timeout.
"""
from __future__ import annotations

import dataclasses
import http.client
import logging
from collections.abc import Sequence

log = logging.getLogger("kvshare.triton")

_FALSE = {"false", "off", "0", "no"}


@dataclasses.dataclass(frozen=True)
class HttpEndpoint:
    host: str
    port: int

    def url(self, path: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{path}"


def tritonserver_args(pid: int) -> list[str]:
    """The command line of process pid (Linux /proc); [] when it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def http_endpoint(args: Sequence[str]) -> HttpEndpoint | None:
    """Where tritonserver started with `args` serves HTTP, as a local client reaches it; None when
    its HTTP endpoint is off. Options take Triton's two forms, `--name=value` and `--name value`."""
    options: dict[str, str] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
        options[name] = value
    if options.get("allow-http", "true").strip().lower() in _FALSE:
        return None
    try:
        port = int(options.get("http-port", "8000"))
    except ValueError:
        return None
    if port <= 0:
        return None
    host = options.get("http-address", "0.0.0.0").strip("[]") or "0.0.0.0"
    # a wildcard address listens on loopback too
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return HttpEndpoint(host, port)


class HttpReadiness:
    """A serving probe: True while the server answers 200 for the model, False once it answers
    anything else (model unloaded, server exiting) or, after it has answered once, refuses the
    connection (Triton 2.51 closes HTTP as soon as it gets SIGTERM, while gRPC streams go on).
    None: cannot tell (not reachable yet, a timeout)."""

    def __init__(self, endpoint: HttpEndpoint, model_name: str, timeout_s: float = 2.0):
        self.endpoint = endpoint
        self.path = f"/v2/models/{model_name}/ready"
        self.timeout_s = timeout_s
        self._answered = False
        self._unsure = False

    def serving_seen(self) -> None:
        """The model has taken a request, so the server serves: from now on a refused connection
        means its HTTP endpoint closed (a shutdown), even if no poll got an answer before. Without
        this a SIGTERM within the first poll interval after the first request (CI, 2026-12-02: 0.7 s
        after start-up) left every answer "cannot tell", and the requests ran on past the exit
        timeout. Triton opens HTTP within a millisecond of gRPC (0.3 ms in that log), before any
        request can reach a model and a poll follow it."""
        self._answered = True

    def __call__(self) -> bool | None:
        conn = http.client.HTTPConnection(self.endpoint.host, self.endpoint.port, timeout=self.timeout_s)
        try:
            conn.request("GET", self.path)
            status = conn.getresponse().status
        except ConnectionRefusedError:
            return False if self._answered else None
        except (OSError, http.client.HTTPException) as exc:
            # logged once per spell: a shutdown the probe cannot see holds every request to its end
            if self._answered and not self._unsure:
                log.warning("shutdown probe %s got no answer (%s: %s); asking again", self, type(exc).__name__, exc)
            self._unsure = True
            return None
        finally:
            conn.close()
        if self._unsure:
            log.info("shutdown probe %s answers again (%d)", self, status)
        self._answered, self._unsure = True, False
        return status == 200

    def __repr__(self) -> str:
        return f"HttpReadiness({self.endpoint.url(self.path)})"
