"""Service-level gates for load tests: pass/fail from request counts and latency percentiles.

Pure functions, so the Locust hook and the tests share one definition of "the run passed".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SloGates:
    max_failure_ratio: Optional[float] = 0.0  # failures / requests must be <= this
    max_p95_ttft_ms: Optional[float] = None
    min_requests: int = 1  # a run that completed nothing proves nothing


@dataclass(frozen=True)
class SloReport:
    requests: int
    failures: int
    p95_ttft_ms: Optional[float]
    violations: tuple[str, ...]

    @property
    def failure_ratio(self) -> float:
        return self.failures / self.requests if self.requests else 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        p95 = "-" if self.p95_ttft_ms is None else f"{self.p95_ttft_ms:.0f}ms"
        verdict = "PASS" if self.ok else "FAIL: " + "; ".join(self.violations)
        return (
            f"SLO {verdict} (requests={self.requests} failures={self.failures} "
            f"failure_ratio={self.failure_ratio:.4f} p95_ttft={p95})"
        )


def evaluate(requests: int, failures: int, p95_ttft_ms: Optional[float], gates: SloGates) -> SloReport:
    """Compare a run's numbers against the gates. ``requests`` counts failed ones too."""
    violations = []
    if requests < gates.min_requests:
        violations.append(f"only {requests} requests (< {gates.min_requests})")
    ratio = failures / requests if requests else 0.0
    if gates.max_failure_ratio is not None and ratio > gates.max_failure_ratio:
        violations.append(f"failure ratio {ratio:.4f} > {gates.max_failure_ratio}")
    if gates.max_p95_ttft_ms is not None:
        if p95_ttft_ms is None:
            violations.append("no TTFT measured")
        elif p95_ttft_ms > gates.max_p95_ttft_ms:
            violations.append(f"p95 TTFT {p95_ttft_ms:.0f}ms > {gates.max_p95_ttft_ms:.0f}ms")
    return SloReport(requests, failures, p95_ttft_ms, tuple(violations))
