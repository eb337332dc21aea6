"""NVIDIA genai-perf (PyPI genai-perf==0.0.16, its own venv from scripts/setup_genai_perf.sh) profiles the
real server end to end: `--endpoint-type kserve --backend tensorrtllm` against `ensemble` and
`--backend vllm` against `vllm_model`, finishing with its report.

genai-perf drives the perf_analyzer binary of the project's .venv (tritonclient[all]==2.51): .venv/bin
comes first on PATH and .venv's nvidia/cuda_runtime/lib goes on LD_LIBRARY_PATH. With
`--output-tokens-mean 16 --output-tokens-mean-deterministic` every request carries max_tokens 16 and
min_length 16 (tensorrtllm) or sampling_parameters {"max_tokens": "16", "min_tokens": "16"} (vllm), so
genai-perf's own count of output tokens (its tokenizer over the joined text deltas) is ~16.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server_helpers import ROOT, wait_for_idle_pool

pytestmark = pytest.mark.server

GP_VENV = ROOT / ".venv-genai-perf"
GP = GP_VENV / "bin" / "genai-perf"
TOKENIZER = GP_VENV / "tokenizer"
REQUESTS = 4
OUTPUT_TOKENS = 16
INPUT_TOKENS = 32
# perf_analyzer 2.51 asks for every output in the model's metadata and exports the FP32 ones a
# response does not carry (cumulative_logprob, cum_log_probs, ...) from uninitialized memory; when
# those bytes read as NaN or Inf its JSON writer stops before its first flush and the export is
# empty (about 1 run in 20 here; docs/decisions.md). The server sends what the vLLM and TensorRT-LLM
# backends send, so such a run is perf_analyzer's own failure: it is run again once.
PA_EMPTY_EXPORT = "Failed to parse JSON string: ''"


@pytest.fixture(scope="module")
def genai_perf_env():
    """The environment genai-perf runs in; the set-up script first (fast when done already)."""
    setup = subprocess.run([str(ROOT / "scripts" / "setup_genai_perf.sh")], cwd=ROOT, capture_output=True,
                           text=True, timeout=900)
    if setup.returncode != 0 or not GP.exists() or not (TOKENIZER / "tokenizer_config.json").exists():
        msg = f"genai-perf could not be installed (scripts/setup_genai_perf.sh exit {setup.returncode}): " \
              f"{(setup.stdout + setup.stderr)[-1500:]}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    assert spec is not None and spec.submodule_search_locations, "nvidia-cuda-runtime-cu12 is missing from .venv"
    cudart = Path(list(spec.submodule_search_locations)[0]) / "lib"
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), str(GP.parent), env.get("PATH", "")))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(cudart), env.get("LD_LIBRARY_PATH", "")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.pop("VIRTUAL_ENV", None)
    env["COLUMNS"] = "160"   # the report table's width
    return env


def profile(env: dict, url: str, model: str, backend: str, tmp_path: Path, *, streaming: bool = True) -> dict:
    """Runs genai-perf profile; returns its *_genai_perf.json report (asserting exit 0 and both files)."""
    cmd = [str(GP), "profile", "-m", model, "--endpoint-type", "kserve", "--backend", backend,
           *(["--streaming"] if streaming else []), "--concurrency", "2",
           "--num-dataset-entries", str(REQUESTS), "--request-count", str(REQUESTS), "--warmup-request-count", "0",
           "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
           "--output-tokens-mean-deterministic", "--random-seed", "7",
           "--tokenizer", str(TOKENIZER), "-u", url, "--artifact-dir", str(tmp_path / "artifacts")]
    for attempt in range(2):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        if attempt or proc.returncode == 0 or PA_EMPTY_EXPORT not in out:
            break
        print(f"perf_analyzer left its export empty (rc 0), genai-perf could not read it; run again once:\n{out[-1500:]}")
        shutil.rmtree(tmp_path / "artifacts", ignore_errors=True)
    assert proc.returncode == 0, f"genai-perf exit {proc.returncode}\n$ {' '.join(cmd)}\n{out[-6000:]}"
    assert "NVIDIA GenAI-Perf | LLM Metrics" in out, out[-4000:]
    [report] = list((tmp_path / "artifacts").rglob("*_genai_perf.json"))
    assert list(report.parent.glob("*_genai_perf.csv")), f"no CSV report beside {report}"
    data = json.loads(report.read_text())
    data["_raw"] = json.loads((report.parent / report.name.replace("_genai_perf.json", ".json")).read_text())
    data["_inputs"] = json.loads((report.parent / "inputs.json").read_text())
    return data


def check_report(data: dict, streaming: bool) -> None:
    assert data["request_count"]["avg"] == REQUESTS, data["request_count"]
    osl = data["output_sequence_length"]
    # genai-perf re-tokenizes the joined text: a token or so either way of the 16 generated.
    assert OUTPUT_TOKENS - 2 <= osl["min"] <= osl["max"] <= OUTPUT_TOKENS + 2, osl
    isl = data["input_sequence_length"]
    assert INPUT_TOKENS - 2 <= isl["avg"] <= INPUT_TOKENS + 2, isl
    assert data["request_latency"]["avg"] > 0
    requests = [r for exp in data["_raw"]["experiments"] for r in exp["requests"]]
    assert len(requests) == REQUESTS
    for r in requests:
        stamps = r["response_timestamps"]
        assert (len(stamps) > 1) if streaming else (len(stamps) == 1), (streaming, r)
    if streaming:
        assert data["time_to_first_token"]["avg"] > 0
        assert data["time_to_first_token"]["avg"] <= data["request_latency"]["avg"]


@pytest.fixture(scope="module")
def server(triton_server):
    yield triton_server
    wait_for_idle_pool(triton_server.metrics_url)


def test_genai_perf_tensorrtllm_backend_ensemble_streaming(server, genai_perf_env, tmp_path):
    data = profile(genai_perf_env, server.grpc_url, "ensemble", "tensorrtllm", tmp_path)
    row = data["_inputs"]["data"][0]
    assert row["min_length"] == [OUTPUT_TOKENS] and row["max_tokens"] == [OUTPUT_TOKENS]   # what was sent
    assert row["stream"] == [True] and row["exclude_input_in_output"] == [True]
    check_report(data, streaming=True)


def test_genai_perf_tensorrtllm_backend_ensemble_not_streaming(server, genai_perf_env, tmp_path):
    data = profile(genai_perf_env, server.grpc_url, "ensemble", "tensorrtllm", tmp_path, streaming=False)
    check_report(data, streaming=False)


def test_genai_perf_vllm_backend_vllm_model_streaming(server, genai_perf_env, tmp_path):
    data = profile(genai_perf_env, server.grpc_url, "vllm_model", "vllm", tmp_path)
    row = data["_inputs"]["data"][0]
    assert json.loads(row["sampling_parameters"][0]) == {"max_tokens": str(OUTPUT_TOKENS),
                                                         "min_tokens": str(OUTPUT_TOKENS)}
    check_report(data, streaming=True)
