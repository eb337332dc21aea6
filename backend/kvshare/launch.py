"""Starts the real Triton Inference Server (the binary inside the nvidia-pytriton wheel) on a model
repository, with the environment its Python-backend stub needs, and waits until it is ready.

    python -m kvshare.launch [--model-repository model_repository] [--host 127.0.0.1] [--grpc-port 8001] ...

Used by scripts/serve.sh (foreground) and by the integration tests (background, own ports).
The server listens on 127.0.0.1 unless told otherwise (`--host 0.0.0.0`: every interface; a
container does that), because tritonserver's own default is every interface and kvshare has no
authentication (docs/operate/security.md).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvshare.launch")


def tritonserver_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("nvidia-pytriton is not installed: run scripts/setup.sh")
    return Path(spec.submodule_search_locations[0]) / "tritonserver"


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The stub links libpython and runs the first python on PATH: make both this interpreter's."""
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # OpenMP's worker threads sleep instead of spinning between the engine's torch ops: on a small
    # CPU they shared the cores with tritonserver, the stubs and the response pump, and spinning took
    # their time (CPU default, seed-12x128 through the server on 2 cores: ITL p50 255-263 -> 231-235 ms,
    # two A/B pairs, docs/decisions.md).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


LOOPBACK = "127.0.0.1"
ANY = ("0.0.0.0", "::")


@dataclass(frozen=True)
class ServerAddress:
    """Where the server listens (host: one address for HTTP, gRPC and metrics) and its ports."""
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def client_host(self) -> str:
        """The address clients on this machine connect to (loopback when listening on every interface)."""
        return LOOPBACK if self.host in ANY else self.host

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.client_host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"


def command(repo: Path, addr: ServerAddress, extra: list[str] = ()) -> list[str]:
    """tritonserver's command line: every endpoint bound to addr.host (tritonserver alone binds 0.0.0.0)."""
    ts = tritonserver_dir()
    return [str(ts / "bin" / "tritonserver"), f"--model-repository={repo}", f"--backend-directory={ts / 'backends'}",
            f"--http-address={addr.host}", f"--grpc-address={addr.host}", f"--metrics-address={addr.host}",
            f"--http-port={addr.http_port}", f"--grpc-port={addr.grpc_port}", f"--metrics-port={addr.metrics_port}",
            "--allow-metrics=true", "--log-verbose=0", *extra]


def is_ready(addr: ServerAddress) -> bool:
    try:
        with urllib.request.urlopen(f"{addr.http_url}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start(repo: Path, addr: ServerAddress, *, log_path: Path | None = None, extra_env: dict[str, str] | None = None,
          extra_args: list[str] = ()) -> subprocess.Popen:
    env = server_env()
    env.update(extra_env or {})
    out = open(log_path, "ab") if log_path else None
    return subprocess.Popen(command(repo, addr, list(extra_args)), env=env, stdout=out or None,
                            stderr=subprocess.STDOUT if out else None, start_new_session=True)


def wait_ready(proc: subprocess.Popen, addr: ServerAddress, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {proc.returncode} before it was ready")
        if is_ready(addr):
            return
        time.sleep(0.5)
    raise TimeoutError(f"tritonserver was not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    log.info("stopping the server (pid %d)", proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.info("tritonserver exited with code %d", proc.returncode)


class StopSignals:
    """SIGINT and SIGTERM for main(): the first one stops the server, by raising KeyboardInterrupt
    to unwind main to its stop(). Once stopping has begun, further ones are logged and not raised:
    an exception inside stop() would abandon the server halfway through its shutdown, to die on its
    own tens of seconds later. A third Ctrl-C kills the server's process group: a user who presses it
    again after being told the server is already stopping wants it gone now. SIGTERMs never do,
    since a process manager that repeats one has its own SIGKILL to send."""

    KILL_AFTER_INTERRUPTS = 3

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.stopping = False
        self.interrupts = 0

    def install(self) -> None:
        signal.signal(signal.SIGINT, self.on_signal)
        signal.signal(signal.SIGTERM, self.on_signal)

    def begin_stop(self) -> None:
        self.stopping = True

    def stopped(self) -> None:
        """The server is gone: a signal from now on is ignored, since on the way out (interpreter
        shutdown restores the default action) it would kill the launcher with the signal's code
        instead of main's."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
        if not self.stopping:
            self.stopping = True      # before raising: a second signal must not interrupt the unwinding
            raise KeyboardInterrupt
        if signum == signal.SIGINT and self.interrupts >= self.KILL_AFTER_INTERRUPTS:
            log.warning("Ctrl-C %d times: killing the server (pid %d)", self.interrupts, self.proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            return
        more = self.KILL_AFTER_INTERRUPTS - self.interrupts
        hint = f"; Ctrl-C {more} more time{'s' if more > 1 else ''} to kill it" if signum == signal.SIGINT else ""
        log.warning("already stopping the server (%s)%s", signal.Signals(signum).name, hint)


STUB_DIED = 70      # main()'s exit code when a Python-backend stub died under a running server


def stub_pids(server_pid: int, model: str | None = None) -> list[int]:
    """The Python-backend stub processes of one tritonserver (its children; Linux /proc), only
    those of `model` when given (a stub's last arguments are "<model>_<instance>_<device> <kind>")."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), None)
        if ppid != server_pid or not args[0].endswith(b"triton_python_backend_stub"):
            continue
        if model is None or any(a.decode(errors="replace").startswith(f"{model}_") for a in args[-3:]):
            found.append(int(entry.name))
    return sorted(found)


def wait_for_stub_death(proc: subprocess.Popen, stubs: list[int], poll_s: float = 1.0) -> int | None:
    """Blocks until one of `stubs` is gone while the server still runs (returns its pid), or until
    the server exits (None). Triton 2.51 neither restarts a dead stub of a decoupled model nor marks
    the model unready: every later request fails with "Stub process ... is not healthy" while
    /v2/health/ready says 200 (docs/operate/troubleshoot.md). Only a restart brings the model back."""
    while proc.poll() is None:
        gone = [pid for pid in stubs if not Path(f"/proc/{pid}").exists() or _is_zombie(pid)]
        if gone:
            return gone[0]
        time.sleep(poll_s)
    return None


def _is_zombie(pid: int) -> bool:
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


def start_openai(addr: ServerAddress, port: int, timeout_s: float = 120.0) -> subprocess.Popen | None:
    """The OpenAI frontend as a child process (not imported: the launcher stays free of its
    dependencies); None, with a warning, when it is not installed or does not come up, because
    Triton itself is still worth serving."""
    if importlib.util.find_spec("kvshare_openai") is None:
        log.warning("--openai-port given but kvshare_openai is not installed (pip install ./openai_frontend)")
        return None
    proc = subprocess.Popen([sys.executable, "-m", "kvshare_openai", "--triton-url", addr.grpc_url,
                             "--host", addr.host, "--port", str(port)])
    url = f"http://{addr.client_host}:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        time.sleep(0.5)
    log.warning("the OpenAI frontend did not become healthy on %s; serving Triton without it", url)
    stop_openai(proc)
    return None


def stop_openai(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    """First on the way out: its open streams are cancelled while Triton can still hear it."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    ap.add_argument("--host", default=LOOPBACK, help="the address HTTP, gRPC and metrics listen on (default "
                    "127.0.0.1: this machine only; 0.0.0.0: every interface, e.g. in a container)")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--openai-port", type=int, default=0, help="also serve the OpenAI-compatible API "
                    "(kvshare_openai) on this port, started after Triton is ready and stopped before it; 0: off")
    ap.add_argument("extra", nargs="*", help="more tritonserver arguments (after --)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[kvshare %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    addr = ServerAddress(args.host, args.http_port, args.grpc_port, args.metrics_port)
    repo = args.model_repository.resolve()
    log.info("starting Triton Inference Server on %s (log below)", repo)
    proc = start(repo, addr, extra_args=args.extra)
    signals = StopSignals(proc)
    signals.install()
    openai_proc = None
    try:
        wait_ready(proc, addr)
        if args.openai_port:
            openai_proc = start_openai(addr, args.openai_port)
        openai = f"  OpenAI http://{addr.client_host}:{args.openai_port}/v1" if openai_proc else ""
        log.info("READY: gRPC %s  HTTP %s  metrics %s%s", addr.grpc_url, addr.http_url, addr.metrics_url, openai)
        log.info("try: .venv/bin/kvshare-client generate --chat --temperature 0 'What is the capital of France?'")
        dead = wait_for_stub_death(proc, stub_pids(proc.pid))
        signals.begin_stop()          # from here on a signal must not interrupt the way out
        if dead is None:
            return proc.returncode
        log.error("a Python-backend stub (pid %d) died; Triton does not restart it and still reports the model "
                  "ready: stopping the server so that it can be restarted", dead)
        return STUB_DIED
    except KeyboardInterrupt:
        return 0
    finally:
        signals.begin_stop()
        stop_openai(openai_proc)
        stop(proc)
        signals.stopped()


if __name__ == "__main__":
    sys.exit(main())
