"""Serving side by side: kvshare through Triton (gRPC streaming) and vLLM's own OpenAI server
(`vllm serve`), driven by one load generator (perf/load/serving_load.py) at the same points.

    python -m perf.peer.serving kvshare --env ENV --out DIR                 # on the GPU machine
    python -m perf.peer.serving vllm --load-env ENV --out DIR               # (vllm importable)
    python -m perf.peer.serving plan                                         # the points, anywhere

Both servers get dummy Llama-2-7B weights (fp16), token-id prompts of perf/core/workload_traces.py
(kvshare: Triton's `llm_engine`; vLLM: `--skip-tokenizer-init`, ids back through
`return_token_ids`), greedy with the output length forced, every token streamed. Ids rather than
text: neither side has a real tokenizer for random weights, and ids give both exactly the same
prompts without a tokenizer's cost on one side only. The same engine limits on both sides: 256
sequences in flight, a 4096-token context. Each point shifts its trace's ids by its own offset, so
no point reads another's prefix from either server's prefix cache; a short warm-up precedes them.

Every point writes NAME.json (serving_load's summary and per-request timings) into --out;
perf/peer/serving_report.py turns the two folders into the table and the plot.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama-2-7b"
MAX_RUNNING = 256
MAX_MODEL_LEN = 4096
KV_GB = 100            # kvshare's pool on an H200; vLLM takes gpu_memory_utilization 0.9 (~110 GB of KV there)
# Off the H200, the pool is what vLLM's 0.9 leaves for KV less a margin: 0.9 x memory - 20 GB of weights
# (13.5), activations and graphs (an H100 80GB: ~57 GB).
WEIGHTS_AND_MARGIN_GB = 20


def kv_gb(total_gb: Optional[float]) -> float:
    """kvshare's pool for a GPU of total_gb (None: unknown, the H200's)."""
    if total_gb is None:
        return KV_GB
    return float(min(KV_GB, int(0.9 * total_gb - WEIGHTS_AND_MARGIN_GB)))


def gpu_total_gb() -> Optional[float]:
    """GPU 0's memory from nvidia-smi (no CUDA context in this process, which outlives the server's)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return float(out.split()[0]) * 2**20 / 1e9
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class ServingPoint:
    name: str
    trace: str                       # perf/core/workload_traces.py
    requests: int                    # its first N requests
    concurrency: Optional[int] = None    # closed loop
    rate: Optional[float] = None         # open loop, Poisson requests/s (inf: all at once)
    processes: int = 1                   # client processes (serving_load --processes)

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError(f"{self.name}: exactly one of concurrency and rate")

    @property
    def loop(self) -> str:
        return "closed" if self.concurrency is not None else "open"


# ShareGPT-like lengths (mixed-1k: ~190 in / ~170 out, up to 1,597 out in the first 200) closed at
# 1-128 and open past saturation (~60 requests/s would be ~10k tok/s), with enough requests that the
# sustained window (first send -> last send) is several seconds long; shared-prefix (2,048 shared +
# 128 / 256 out) closed at 64 and 256. More client processes where the token rate is high.
POINTS: tuple[ServingPoint, ...] = (
    ServingPoint("mixed-c1", "mixed-1k", 8, concurrency=1),
    ServingPoint("mixed-c16", "mixed-1k", 200, concurrency=16, processes=2),
    ServingPoint("mixed-c64", "mixed-1k", 400, concurrency=64, processes=2),
    ServingPoint("mixed-c128", "mixed-1k", 400, concurrency=128, processes=4),
    ServingPoint("mixed-r8", "mixed-1k", 200, rate=8.0, processes=2),
    ServingPoint("mixed-r16", "mixed-1k", 200, rate=16.0, processes=2),
    ServingPoint("mixed-r32", "mixed-1k", 400, rate=32.0, processes=4),
    ServingPoint("mixed-r64", "mixed-1k", 500, rate=64.0, processes=4),
    ServingPoint("shared-prefix-c64", "shared-prefix", 256, concurrency=64, processes=2),
    ServingPoint("shared-prefix-c256", "shared-prefix", 256, concurrency=256, processes=4),
)
BY_NAME = {p.name: p for p in POINTS}
WARMUP = ServingPoint("warmup", "fixed-64", 64, concurrency=64)
WARMUP_TOKENS = 16
POINT_TIMEOUT_S = 150


def id_offset(index: int) -> int:
    return 1000 * (index + 1)


def load_command(python: str, target: str, url: str, model: str, point: ServingPoint, index: int,
                 out: Path, output_tokens: Optional[int] = None, vocab: Optional[int] = None) -> list[str]:
    cmd = [python, "-m", "perf.load.serving_load", "--target", target, "--url", url, "--model", model,
           "--trace", point.trace, "--requests", str(point.requests), "--processes", str(point.processes),
           "--id-offset", str(id_offset(index)), "--timeout-s", str(POINT_TIMEOUT_S - 10),
           "--max-seconds", str(POINT_TIMEOUT_S - 5), "--json", str(out / f"{point.name}.json")]
    cmd += ["--concurrency", str(point.concurrency)] if point.concurrency is not None else ["--rate", str(point.rate)]
    if output_tokens:
        cmd += ["--output-tokens", str(output_tokens)]
    if vocab:
        cmd += ["--vocab", str(vocab)]
    return cmd


def load_env() -> dict[str, str]:
    """The load generator's environment: the repo's packages only (no vLLM site on its path)."""
    from perf.gpu.env import python_path

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(python_path())
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_points(python: str, target: str, url: str, model: str, out: Path, points: Sequence[ServingPoint],
               vocab: Optional[int] = None, spans: Optional[list] = None) -> int:
    """The warm-up, then every point; returns how many failed. spans, when given, receives
    (name, wall-clock start, end) of the warm-up and of each point."""
    out.mkdir(parents=True, exist_ok=True)
    env = load_env()
    failed = 0
    warm = load_command(python, target, url, model, WARMUP, -1, out, WARMUP_TOKENS, vocab)
    print(f"[serving] warm-up: {' '.join(warm[1:])}", flush=True)
    started = time.time()
    subprocess.run(warm, env=env, cwd=ROOT, timeout=POINT_TIMEOUT_S)
    if spans is not None:
        spans.append((WARMUP.name, started, time.time()))
    for i, p in enumerate(points):
        t0, started = time.monotonic(), time.time()
        cmd = load_command(python, target, url, model, p, POINTS.index(BY_NAME[p.name]) if p.name in BY_NAME else i, out, vocab=vocab)
        print(f"[serving] {target} {p.name}: {p.requests} x {p.trace}, {p.loop} loop "
              f"({'c=' + str(p.concurrency) if p.concurrency else 'rate ' + str(p.rate) + '/s'}), "
              f"{p.processes} client process(es)", flush=True)
        try:
            rc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=POINT_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        failed += rc != 0
        if spans is not None:
            spans.append((p.name, started, time.time()))
        print(f"[serving] {p.name} rc={rc} in {time.monotonic() - t0:.1f} s", flush=True)
    return failed


def late_compiles(cache_dir: Path, ready: float, spans: Sequence[tuple[str, float, float]]) -> list[dict]:
    """Triton kernels compiled once the server was ready, from the JIT cache's files (a <kernel>.json
    per compiled variant), each with the warm-up or point it fell in: every such compile holds every
    stream while it runs (~0.4 s for the page copy on the H200, docs/develop/engine.md)."""
    out = []
    for path in cache_dir.rglob("*.json"):
        at = path.stat().st_mtime
        if path.name.startswith("__grp") or at <= ready:
            continue
        during = next((name for name, start, end in spans if start <= at <= end), "between points")
        out.append({"kernel": path.stem, "after_ready_s": round(at - ready, 2), "during": during})
    return sorted(out, key=lambda c: c["after_ready_s"])


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def selected(names: str, processes: Optional[int] = None) -> tuple[ServingPoint, ...]:
    unknown = [n for n in names.split(",") if n not in BY_NAME] if names else []
    if unknown:
        raise SystemExit(f"--points: unknown {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    if processes is not None and processes < 1:
        raise SystemExit(f"--processes must be >= 1, got {processes}")
    points = tuple(BY_NAME[n] for n in names.split(",")) if names else POINTS
    return points if processes is None else tuple(replace(p, processes=processes) for p in points)


# ------------------------------------------------------------------ kvshare through Triton

def kvshare_env(total_gb: Optional[float] = None) -> dict[str, str]:
    """The engine's settings (KVSHARE_*) of the GPU serving run, beside the defaults."""
    return dict(KVSHARE_DEVICE="cuda", KVSHARE_MODEL=f"dummy:{MODEL}", KVSHARE_DTYPE="float16",
                KVSHARE_KV_CACHE_MEMORY_GB=f"{kv_gb(total_gb):g}", KVSHARE_MAX_RUNNING=str(MAX_RUNNING),
                KVSHARE_MAX_STEP_TOKENS="4096", KVSHARE_MAX_PREFILL_CHUNK="2048", KVSHARE_PAGE_SIZE="16",
                KVSHARE_MAX_MODEL_LEN=str(MAX_MODEL_LEN), KVSHARE_DEBUG_CHECKS="false", KVSHARE_LOG_LEVEL="INFO")


def env_python(env_dir: Path) -> str:
    """PY= of the activate.sh that perf/gpu/env.py server-venv wrote into env_dir (the numpy<2
    virtualenv the Triton stub needs)."""
    activate = env_dir / "activate.sh"
    for line in activate.read_text().splitlines():
        if line.startswith("PY="):
            return line[3:].strip()
    raise SystemExit(f"{activate}: no PY= line")


def _exit_on_sigterm() -> None:
    """A stage's time limit sends SIGTERM: unwind, so that `finally` stops the server (it runs in a
    session of its own and would outlive this command, holding the GPU's memory)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def cmd_kvshare(args: argparse.Namespace) -> int:
    _exit_on_sigterm()
    py = env_python(args.env) if args.env else sys.executable
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    # KVSHARE_* already set win (a CPU check: KVSHARE_DEVICE=cpu KVSHARE_MODEL=dummy:tiny-llama ...);
    # an engine process (KVSHARE_ENGINE_PROCESS=on) runs on the server's own virtualenv
    env = {**kvshare_env(gpu_total_gb()), "KVSHARE_ENGINE_PYTHON": py, **os.environ}
    # A JIT cache of this run's own (unless one is set): the kernels compiled once the server is
    # ready are read from its files, and it goes with the run.
    own_cache = "TRITON_CACHE_DIR" not in env
    if own_cache:
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvshare-serving-triton-")
    try:
        return _serve_points(args, py, env, Path(env["TRITON_CACHE_DIR"]), out)
    finally:
        if own_cache:
            shutil.rmtree(env["TRITON_CACHE_DIR"], ignore_errors=True)


def _serve_points(args: argparse.Namespace, py: str, env: dict[str, str], cache: Path, out: Path) -> int:
    """Starts the server, runs the points, stops it; writes late-compiles.json."""
    http, grpc, metrics = free_ports(3)
    pid_file = out / "kvshare-server.pid"
    server = [py, str(ROOT / "perf/server/fullstack_server.py")]
    rc = subprocess.run([*server, "start", "--ports", f"{http},{grpc},{metrics}", "--models", "llm_engine",
                         "--log", str(out / "kvshare-server.log"), "--pid-file", str(pid_file),
                         "--ready-timeout", "240"], env=env, cwd=ROOT).returncode
    if rc != 0:
        return rc
    ready, spans = time.time(), []
    try:
        failed = run_points(py, "triton", f"127.0.0.1:{grpc}", "llm_engine", out, selected(args.points, args.processes),
                            args.vocab, spans)
    finally:
        subprocess.run([*server, "stop", "--pid-file", str(pid_file)], cwd=ROOT)
    late = late_compiles(cache, ready, spans)
    (out / "late-compiles.json").write_text(json.dumps(late, indent=1))
    print(f"[serving] {len(late)} kernel(s) compiled after the server was ready, "
          f"{sum(c['during'] != WARMUP.name for c in late)} of them past the warm-up: "
          + (", ".join(f"{c['kernel']} ({c['during']})" for c in late) or "none"), flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------ vLLM's OpenAI server

def vllm_command(python: str, model_dir: Path, port: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--served-model-name", MODEL,
            "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float16", "--seed", "0",
            "--max-num-seqs", str(MAX_RUNNING), "--max-model-len", str(MAX_MODEL_LEN),
            "--gpu-memory-utilization", "0.9", "--host", "127.0.0.1", "--port", str(port)]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1.0)
    return False


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> str:
    if proc.poll() is not None:
        return f"exited {proc.returncode}"
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace_s)
        return "stopped"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        return "killed"


def cmd_vllm(args: argparse.Namespace) -> int:
    from perf.peer.vllm_offline import model_dir

    _exit_on_sigterm()
    # A Triton server that outlived an earlier command would hold the GPU's memory.
    subprocess.run(["pkill", "-KILL", "-f", "bin/tritonserver"], check=False)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    path = model_dir(MODEL, "float16", Path(args.model_root))
    (port,) = free_ports(1)
    cmd = vllm_command(sys.executable, path, port)
    (out / "vllm-server.cmd").write_text(" ".join(cmd) + "\n")
    print(f"[serving] starting: {' '.join(cmd)}", flush=True)
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    t0 = time.monotonic()
    with open(out / "vllm-server.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        if not wait_http(f"http://127.0.0.1:{port}/v1/models", proc, args.ready_timeout):
            print(f"[serving] vllm serve not ready (rc {proc.poll()}); its log's end:", flush=True)
            print((out / "vllm-server.log").read_text(errors="replace")[-6000:], flush=True)
            return 1
        print(f"[serving] vllm serve ready after {time.monotonic() - t0:.1f} s", flush=True)
        load_python = env_python(args.load_env) if args.load_env else sys.executable
        failed = run_points(load_python, "openai", f"http://127.0.0.1:{port}", MODEL, out,
                            selected(args.points, args.processes))
    finally:
        print(f"[serving] vllm serve: {stop_process_group(proc)}", flush=True)
    return 1 if failed else 0


def cmd_plan(args: argparse.Namespace) -> int:
    for i, p in enumerate(selected(args.points, args.processes)):
        loop = f"c={p.concurrency}" if p.concurrency is not None else f"rate {p.rate}/s"
        print(f"{p.name:22s} {p.requests:4d} x {p.trace:14s} {p.loop:6s} {loop:12s} {p.processes} proc, "
              f"ids + {id_offset(i)}")
    print(json.dumps(dict(kvshare_env=kvshare_env(), vllm=vllm_command("python3", Path("MODEL_DIR"), 0)[3:])))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.peer.serving", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("kvshare", "vllm", "plan"):
        p = sub.add_parser(name)
        p.add_argument("--points", default=os.environ.get("SERVING_POINTS", ""),
                       help="comma-separated point names (default: $SERVING_POINTS, else all; the variable "
                            "reaches the suite's stages: a shorter lease of `perf.gpu peer-serving`)")
        p.add_argument("--processes", type=int, default=None,
                       help="client processes at every point instead of each point's own (serving_load's "
                            "client_cpu_per_s near 1 says a process paced its streams)")
        if name != "plan":
            p.add_argument("--out", type=Path, required=True)
    sub.choices["kvshare"].add_argument("--vocab", type=int, default=None,
                                        help="fold the traces' ids into a smaller vocabulary (a CPU check, tiny model)")
    sub.choices["kvshare"].add_argument("--env", type=Path, default=None,
                                        help="perf/gpu/env.py server-venv's folder (default: this interpreter)")
    sub.choices["vllm"].add_argument("--load-env", type=Path, default=None,
                                     help="the server-venv folder of the load generator's interpreter (default: this one)")
    sub.choices["vllm"].add_argument("--model-root", default="/tmp/kvshare-serving/models")
    sub.choices["vllm"].add_argument("--ready-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    return {"kvshare": cmd_kvshare, "vllm": cmd_vllm, "plan": cmd_plan}[args.cmd](args)


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
