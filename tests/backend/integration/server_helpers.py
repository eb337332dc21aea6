"""Small helpers shared by the integration tests (they talk to the real server through kvshare_client)."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkout_engine_repository(where: Path) -> Path:
    """A model repository with only llm_engine whose entry point imports this checkout's kvshare.

    The Python backend's stub starts its interpreter ignoring the environment (sys.flags.ignore_environment
    is 1 there), so PYTHONPATH does not reach it and `import kvshare` finds whatever the venv's
    install points at, which may be another checkout. The entry point here puts this checkout first."""
    model = where / "llm_engine"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text((ROOT / "model_repository" / "llm_engine" / "config.pbtxt").read_text())
    paths = [str(ROOT / sub) for sub in ("backend", "kernels", "client")]
    (model / "1" / "model.py").write_text(
        f"import sys\nsys.path[:0] = {paths!r}\n"
        "from kvshare.triton_adapter.llm_engine_model import LLMEngineModel as TritonPythonModel  # noqa: E402,F401\n")
    return where


@contextlib.contextmanager
def own_llm_engine_server(env: dict[str, str], name: str) -> Iterator[object]:
    """A real Triton server of a test module's own, on free ports, with only llm_engine loaded (this
    checkout's code) and the engine settings in env (KVSHARE_*); yields its launch.ServerAddress,
    stops it after."""
    from kvshare import launch

    addr = launch.ServerAddress("127.0.0.1", free_port(), free_port(), free_port())
    work = Path(tempfile.mkdtemp(prefix=f"kvshare-{name}-server-"))
    log_path = work / "tritonserver.log"
    proc = launch.start(checkout_engine_repository(work / "models"), addr, log_path=log_path, extra_env=env,
                        extra_args=["--model-control-mode=explicit", "--load-model=llm_engine",
                                    "--exit-timeout-secs=10"])
    try:
        launch.wait_ready(proc, addr, timeout_s=float(os.environ.get("KVSHARE_TEST_SERVER_TIMEOUT", "400")))
    except Exception as exc:
        launch.stop(proc)
        pytest.fail(f"the Triton server did not start: {exc}\n{log_path.read_text(errors='replace')[-6000:]}")
    try:
        yield addr
    finally:
        launch.stop(proc)


def post(url: str, body: dict, timeout: float = 300.0) -> tuple[int, str, str]:
    """(HTTP status, Content-Type, body text) of a JSON POST."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode("utf-8")
