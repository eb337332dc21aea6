"""Read the server's Prometheus metrics (Triton's metrics port, default :8002/metrics)."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass
from typing import Iterable, Optional

from .errors import ServerUnavailable

_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class MetricSample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


def metrics_url(url: str) -> str:
    """Accept 'host:port', 'http://host:port' or a full '.../metrics' URL."""
    if "://" not in url:
        url = "http://" + url
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def fetch_metrics(url: str, timeout: float = 5.0) -> str:
    try:
        with urllib.request.urlopen(metrics_url(url), timeout=timeout) as resp:
            return resp.read().decode("utf-8")
    except OSError as exc:  # URLError, connection refused, timeout
        raise ServerUnavailable(f"cannot fetch metrics from {metrics_url(url)}: {exc}") from exc


def filter_lines(text: str, prefix: str = "kvshare_") -> list[str]:
    """The exposition lines (HELP/TYPE comments included) of metrics whose name starts with prefix."""
    keep = []
    for line in text.splitlines():
        body = (
            line[len("# HELP ") :]
            if line.startswith("# HELP ")
            else line[len("# TYPE ") :]
            if line.startswith("# TYPE ")
            else line
        )
        if body.startswith(prefix):
            keep.append(line)
    return keep


def parse_samples(text: str | Iterable[str]) -> list[MetricSample]:
    lines = text.splitlines() if isinstance(text, str) else text
    out = []
    for line in lines:
        if line.startswith("#") or not line.strip():
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = tuple(_LABEL.findall(m.group("labels") or ""))
        out.append(MetricSample(m.group("name"), labels, float(m.group("value"))))
    return out


def metric_total(samples: Iterable[MetricSample], name: str) -> Optional[float]:
    """Sum of a metric over all label sets; None when the server does not export it."""
    values = [s.value for s in samples if s.name == name]
    return sum(values) if values else None
