"""One real Triton server (llm_engine + llm_bls, the embedded SmolLM2 on the CPU) and one OpenAI
frontend process in front of it, shared by the module."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "backend" / "integration"))

from server_helpers import free_port, own_server  # noqa: E402

# Small enough that a burst of 8 requests overflows it (the overload test), large enough for n = 2.
MAX_QUEUED = 4


@dataclass(frozen=True)
class Frontend:
    base_url: str          # http://127.0.0.1:<port>/v1
    root_url: str          # http://127.0.0.1:<port>
    metrics_url: str       # Triton's metrics (the engine's pool gauges)
    model: str


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the frontend exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError("the frontend did not become healthy")


@pytest.fixture(scope="module")
def frontend():
    env = {"KVSHARE_MAX_QUEUED_REQUESTS": str(MAX_QUEUED), "KVSHARE_LOG_LEVEL": "INFO"}
    with own_server(env, "openai", models=("llm_engine", "llm_bls")) as server:
        port = free_port()
        log = open(server.log_path.with_name("frontend.log"), "w")
        proc = subprocess.Popen([sys.executable, "-m", "kvshare_openai", "--triton-url", server.addr.grpc_url,
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, HF_HUB_OFFLINE="1",
                                         PYTHONPATH=str(ROOT / "openai_frontend")))
        root = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(root, proc, 120)
            yield Frontend(root + "/v1", root, server.addr.metrics_url, "SmolLM2-135M-Instruct")
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
