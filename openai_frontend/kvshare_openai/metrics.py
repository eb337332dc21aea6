"""The frontend's own counters in Prometheus' text format (no prometheus_client dependency).

Triton's :8002 has the engine's metrics; these are what only the HTTP side sees: requests by route
and status, tokens, cached prompt tokens, clients that left mid-request.
"""
from __future__ import annotations

import threading
from collections import Counter


class FrontendMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, int]] = Counter()
        self._tokens: Counter[str] = Counter()
        self._disconnects = 0
        self._in_flight = 0

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self._requests[(route, status)] += 1

    def tokens(self, prompt: int, completion: int, cached: int) -> None:
        with self._lock:
            self._tokens["prompt"] += prompt
            self._tokens["completion"] += completion
            self._tokens["cached"] += cached

    def disconnect(self) -> None:
        with self._lock:
            self._disconnects += 1

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def render(self) -> str:
        with self._lock:
            lines = ["# HELP kvshare_openai_requests_total HTTP requests by route and status",
                     "# TYPE kvshare_openai_requests_total counter"]
            for (route, status), v in sorted(self._requests.items()):
                lines.append(f'kvshare_openai_requests_total{{route="{route}",status="{status}"}} {v}')
            for kind, doc in (("prompt", "Prompt tokens of answered requests"),
                              ("completion", "Generated tokens sent to clients"),
                              ("cached", "Prompt tokens served from kvshare's shared KV pages")):
                name = f"kvshare_openai_{kind}_tokens_total"
                lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter", f"{name} {self._tokens[kind]}"]
            lines += ["# HELP kvshare_openai_client_disconnects_total Requests whose client left before the end "
                      "(their Triton stream was cancelled)", "# TYPE kvshare_openai_client_disconnects_total counter",
                      f"kvshare_openai_client_disconnects_total {self._disconnects}",
                      "# HELP kvshare_openai_requests_in_flight Requests being generated",
                      "# TYPE kvshare_openai_requests_in_flight gauge",
                      f"kvshare_openai_requests_in_flight {self._in_flight}"]
            return "\n".join(lines) + "\n"
