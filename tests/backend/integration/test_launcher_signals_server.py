"""python -m kvshare.launch (scripts/serve.sh) as a process of its own, serving llm_engine with dummy
weights: signals that arrive while it stops the server are logged, not raised, so the stop runs to
its end (the server exits by itself, code 0) and the launcher exits 0; a third Ctrl-C kills the
server instead."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_helpers import checkout_model_repository, free_port

pytestmark = pytest.mark.server

ENV = {"KVSHARE_MODEL": "dummy:tiny-llama", "KVSHARE_DEBUG_CHECKS": "true"}


def start_launcher(log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvshare.launch", "--model-repository", str(checkout_model_repository()),
           "--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
           "--", "--model-control-mode=explicit", "--load-model=llm_engine", "--exit-timeout-secs=10"]
    out = open(log_path, "wb")
    return subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=out, stderr=subprocess.STDOUT)


def wait_for_line(proc: subprocess.Popen, log_path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no '{text}' from the launcher (rc {proc.poll()}):\n{log_path.read_text(errors='replace')[-6000:]}")
        time.sleep(0.02)


@pytest.fixture
def launcher(tmp_path):
    log_path = tmp_path / "launch.log"
    proc = start_launcher(log_path)
    try:
        # the launcher's own line, after the health check: the server's model table says READY earlier
        wait_for_line(proc, log_path, "READY: gRPC", float(os.environ.get("KVSHARE_TEST_SERVER_TIMEOUT", "400")))
        yield proc, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def server_pid(log_path: Path) -> int:
    line = next(x for x in log_path.read_text().splitlines() if "stopping the server (pid" in x)
    return int(line.rsplit("pid ", 1)[1].rstrip(")"))


def test_signals_during_the_stop_are_logged_and_the_server_exits_by_itself(launcher):
    proc, log_path = launcher
    proc.send_signal(signal.SIGTERM)
    wait_for_line(proc, log_path, "stopping the server", 10)
    proc.send_signal(signal.SIGTERM)           # e.g. a process manager repeating itself
    proc.send_signal(signal.SIGINT)            # and a Ctrl-C
    rc = proc.wait(60)
    text = log_path.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    assert text.count("already stopping the server") == 2, text[-4000:]
    assert "tritonserver exited with code 0" in text and "Traceback" not in text, text[-4000:]
    assert not Path(f"/proc/{server_pid(log_path)}").exists()


def test_a_third_ctrl_c_kills_the_server(launcher):
    proc, log_path = launcher
    proc.send_signal(signal.SIGINT)
    wait_for_line(proc, log_path, "stopping the server", 10)
    proc.send_signal(signal.SIGINT)
    wait_for_line(proc, log_path, "Ctrl-C 1 more time to kill it", 10)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    text = log_path.read_text(errors="replace")
    assert "Ctrl-C 3 times: killing the server" in text and f"exited with code {-signal.SIGKILL}" in text, text[-4000:]
    assert not Path(f"/proc/{server_pid(log_path)}").exists()
