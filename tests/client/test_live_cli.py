"""kvshare-client against the real server (fixture `triton_server` from tests/conftest.py)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.server


def cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "kvshare_client", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_streams_a_real_completion(triton_server):
    p = cli(
        "generate",
        "What is the capital of France?",
        "--chat",
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--url",
        triton_server.grpc_url,
    )
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout  # SmolLM2-135M-Instruct, greedy (shared/environment.md)
    summary = p.stderr.strip().splitlines()[-1]
    for field in ("tokens=", "ttft=", "tok/s=", "cached_tokens=", "finish_reason="):
        assert field in summary, summary


def test_generate_json_reports_counts_and_timings(triton_server):
    p = cli(
        "generate",
        "Write one sentence about the sea.",
        "--chat",
        "--max-tokens",
        "8",
        "--json",
        "--url",
        triton_server.grpc_url,
    )
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout)
    assert c["text"] and c["finish_reason"] in ("stop", "length")
    assert 1 <= c["num_output_tokens"] <= 8 and c["num_input_tokens"] > 0
    assert c["cached_tokens"] is not None and 0 <= c["cached_tokens"] <= c["num_input_tokens"]
    assert 0 < c["ttft_ms"] <= c["e2e_ms"]


def test_generate_on_the_token_model(triton_server):
    p = cli(
        "generate",
        "504 3458 314 253 4214 30",
        "--model",
        "llm_engine",
        "--max-tokens",
        "4",
        "--json",
        "--url",
        triton_server.grpc_url,
    )
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout)
    assert 1 <= len(c["token_ids"]) <= 4 and c["model"] == "llm_engine"


def test_bad_input_is_reported_with_the_field_name(triton_server):
    p = cli("generate", "hi", "--max-tokens", "0", "--url", triton_server.grpc_url)
    assert p.returncode == 1
    assert "max_tokens" in p.stderr


def test_health_and_metrics(triton_server):
    p = cli("health", "--url", triton_server.grpc_url)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "model ensemble: ready" in p.stdout and "model llm_engine: ready" in p.stdout
    p = cli("metrics", "--url", triton_server.grpc_url, "--metrics-url", triton_server.metrics_url)
    assert p.returncode == 0, p.stderr
    assert "kvshare_kv_pages_total" in p.stdout and "nv_inference" not in p.stdout
