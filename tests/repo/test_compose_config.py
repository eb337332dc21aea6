"""docker-compose.yml: valid for Debian 12's docker-compose (1.29, `docker-compose config`, no engine
needed; scripts/setup.sh installs it), and its services point at files and ports that exist."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
SERVICES = {"triton", "triton-cpu", "openai", "prometheus", "loadgen"}


def _compose(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (Debian package docker-compose, in scripts/setup.sh's list)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    return subprocess.run([exe, "-f", str(COMPOSE), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_docker_compose_config_quiet():
    r = _compose("config", "-q")
    assert r.returncode == 0, r.stderr


def test_docker_compose_lists_every_service():
    r = _compose("--profile", "cpu", "--profile", "tools", "config", "--services")
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == SERVICES


def _spec() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(COMPOSE.read_text())


def test_builds_and_mounts_exist():
    services = _spec()["services"]
    assert set(services) == SERVICES
    for name, svc in services.items():
        if "build" in svc:
            assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file(), name
        for vol in svc.get("volumes", []):
            host = vol.split(":", 1)[0]
            if name == "prometheus":
                assert (ROOT / host).is_file(), vol
    assert services["triton"]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert services["loadgen"]["build"]["dockerfile"] == "deploy/Dockerfile.loadgen"


def test_prometheus_scrapes_the_server_metrics_port():
    yaml = pytest.importorskip("yaml")
    services = _spec()["services"]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = [t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert "triton:8002" in targets
    assert "8002:8002" in services["triton"]["ports"] and "8002:8002" in services["triton-cpu"]["ports"]
    # the CPU server answers to the same name, so that prometheus and loadgen find either one
    assert "triton" in services["triton-cpu"]["networks"]["default"]["aliases"]
    assert "--metrics-port=8002" in (ROOT / "deploy" / "Dockerfile").read_text()
