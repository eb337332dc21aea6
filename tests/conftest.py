"""Shared fixtures. `triton_server` starts the REAL Triton Inference Server on model_repository/
(SmolLM2-135M-Instruct on the CPU) once per test session, on free ports."""
from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_finish(session) -> None:
    """Locust monkey-patches threading with gevent on import; in the pytest process that turns the
    tests' threads into greenlets and has crashed torch (a segfault in a threaded all-reduce).
    Locust belongs in its own process (the soak, run_locust.sh): fail at once if a test module
    pulled it in."""
    leaked = [m for m in ("gevent", "locust") if m in sys.modules]
    if leaked:
        raise pytest.UsageError(f"collecting the tests imported {leaked} into the pytest process; import "
                                "locust-based modules (kvshare_client.locust_user, perf.load.soak.users) "
                                "only in a subprocess")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checkout_repository() -> Path:
    """The whole model repository, its stubs importing this checkout's packages (server_helpers)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "kvshare_test_server_helpers", ROOT / "tests" / "backend" / "integration" / "server_helpers.py")
    helpers = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = helpers        # its dataclasses look their module up there
    spec.loader.exec_module(helpers)
    models = tuple(sorted(p.parent.name for p in (ROOT / "model_repository").glob("*/config.pbtxt")))
    return helpers.checkout_model_repository(models)


@pytest.fixture(scope="session")
def triton_server():
    from kvshare import launch

    addr = launch.ServerAddress("127.0.0.1", _free_port(), _free_port(), _free_port())
    log_path = Path(tempfile.mkdtemp(prefix="kvshare-server-")) / "tritonserver.log"
    # A small in-flight limit so the overload test can reach it; no other test runs more than 16 at once.
    env = {"KVSHARE_DEBUG_CHECKS": "true", "KVSHARE_LOG_LEVEL": "INFO", "KVSHARE_MAX_QUEUED_REQUESTS": "24"}
    proc = launch.start(_checkout_repository(), addr, log_path=log_path, extra_env=env)
    try:
        launch.wait_ready(proc, addr, timeout_s=float(os.environ.get("KVSHARE_TEST_SERVER_TIMEOUT", "400")))
    except Exception as exc:
        launch.stop(proc)
        tail = log_path.read_text(errors="replace")[-6000:]
        pytest.fail(f"the Triton server did not start: {exc}\n--- server log tail ---\n{tail}")
    yield addr
    launch.stop(proc)
    if os.environ.get("KVSHARE_TEST_SHOW_SERVER_LOG"):
        print(log_path.read_text(errors="replace")[-4000:])


@pytest.fixture(scope="session")
def tokenizer():
    from kvshare.runtime.tokenizer import load_tokenizer

    return load_tokenizer(None)
