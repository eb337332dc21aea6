"""Small helpers shared by the integration tests (they talk to the real server through kvshare_client)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvshare_client.metrics import fetch_metrics, metric_total, parse_samples

ROOT = Path(__file__).resolve().parents[3]

POOL_GAUGES = ("kvshare_kv_pages_total", "kvshare_kv_pages_free", "kvshare_kv_pages_active", "kvshare_kv_pages_cached")


def pool_gauges(metrics_url: str) -> dict[str, float]:
    samples = parse_samples(fetch_metrics(metrics_url))
    return {name: metric_total(samples, name) for name in (*POOL_GAUGES, "kvshare_requests_running",
                                                          "kvshare_requests_waiting")}


def wait_for_idle_pool(metrics_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Polls the metrics port (published every ~0.5 s) until no page is referenced by a request."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = pool_gauges(metrics_url)
        if g["kvshare_kv_pages_active"] == 0 and g["kvshare_requests_running"] == 0 \
                and g["kvshare_requests_waiting"] == 0:
            return g
        if time.monotonic() > deadline:
            raise AssertionError(f"pages still referenced after {timeout_s} s: {g}")
        time.sleep(0.25)


def wait_for_counter(metrics_url: str, name: str, timeout_s: float = 10.0) -> float:
    """A counter's total once it is above zero: the metrics port publishes a snapshot every ~0.5 s,
    so on a busy machine an idle-looking snapshot can predate the last request's counts."""
    deadline = time.monotonic() + timeout_s
    while True:
        total = metric_total(parse_samples(fetch_metrics(metrics_url)), name)
        if total > 0 or time.monotonic() > deadline:
            return total
        time.sleep(0.25)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class OwnServer:
    """A server a test started: its address, its tritonserver process and its log."""
    addr: object                # launch.ServerAddress
    proc: object                # subprocess.Popen of tritonserver
    log_path: Path

    def stub_pids(self, model: str | None = None) -> list[int]:
        """The Python-backend stub processes of this server (children of its tritonserver), only
        those of `model` when given: never another server's."""
        from kvshare import launch

        return launch.stub_pids(self.proc.pid, model)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def checkout_model_repository(models: tuple[str, ...] = ("llm_engine",)) -> Path:
    """A copy of the models whose Python stub imports this checkout's kvshare and kvshare_kernels.

    The stub runs its interpreter isolated (it ignores PYTHONPATH), so it imports what the venv's
    editable install points at, which need not be this checkout; a package link in the model's
    directory (on the stub's sys.path) comes first.
    """
    root = Path(tempfile.mkdtemp(prefix="kvshare-repo-"))
    for model in models:
        shutil.copytree(ROOT / "model_repository" / model, root / model)
        for package, base in (("kvshare", ROOT / "backend"), ("kvshare_kernels", ROOT / "kernels")):
            (root / model / package).symlink_to(base / package, target_is_directory=True)
    return root


@contextlib.contextmanager
def own_server(env: dict[str, str], name: str, models: tuple[str, ...] = ("llm_engine",),
               extra_args: tuple[str, ...] = ("--exit-timeout-secs=10",)) -> Iterator[OwnServer]:
    """A real Triton server of a test module's own, on free ports, with only `models` loaded and the
    engine settings in env (KVSHARE_*), running this checkout's code (checkout_model_repository);
    yields an OwnServer, stops it after (if still running)."""
    from kvshare import launch

    addr = launch.ServerAddress("127.0.0.1", free_port(), free_port(), free_port())
    log_path = Path(tempfile.mkdtemp(prefix=f"kvshare-{name}-server-")) / "tritonserver.log"
    proc = launch.start(checkout_model_repository(models), addr, log_path=log_path, extra_env=env,
                        extra_args=["--model-control-mode=explicit", *(f"--load-model={m}" for m in models),
                                    *extra_args])
    try:
        launch.wait_ready(proc, addr, timeout_s=float(os.environ.get("KVSHARE_TEST_SERVER_TIMEOUT", "400")))
    except Exception as exc:
        launch.stop(proc)
        pytest.fail(f"the Triton server did not start: {exc}\n{log_path.read_text(errors='replace')[-6000:]}")
    try:
        yield OwnServer(addr, proc, log_path)
    finally:
        launch.stop(proc)


@contextlib.contextmanager
def own_llm_engine_server(env: dict[str, str], name: str) -> Iterator[object]:
    """own_server with only llm_engine; yields its launch.ServerAddress."""
    with own_server(env, name) as server:
        yield server.addr


def post(url: str, body: dict, timeout: float = 300.0) -> tuple[int, str, str]:
    """(HTTP status, Content-Type, body text) of a JSON POST."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode("utf-8")
