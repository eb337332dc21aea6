#!/usr/bin/env python3
"""Start the real Triton server on the repo's model repository in the background, the way
scripts/serve.sh does (kvshare.launch: the binary of the installed nvidia-pytriton package, this
interpreter's libpython and PATH for the Python-backend stub), and wait until it is ready.

    python perf/server/fullstack_server.py start --ports 8000,8001,8002 --log server.log --pid-file server.pid \
        [--ready-timeout 240] [--models llm_engine]
    python perf/server/fullstack_server.py stop --pid-file server.pid

`start` returns once /v2/health/ready answers (exit 0), or stops the server and exits 1. The server
keeps running in its own process group (pid in --pid-file) until `stop` (SIGINT to the group, then
SIGKILL after --grace seconds). Engine settings come from KVSHARE_* variables in the environment.
Only --models are loaded (explicit model control): `preprocessing` and `llm_bls` need a tokenizer,
which dummy-weight models do not have.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_group(pgid: int, grace_s: float = 30.0) -> str:
    """SIGINT to the server's process group (tritonserver + its stubs), SIGKILL if still there."""
    if not _group_alive(pgid):
        return "not running"
    os.killpg(pgid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return "stopped"
        if not _alive(pgid):   # tritonserver itself is gone; a stub left behind only holds memory
            break
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return "stopped"
    for _ in range(50):
        if not _group_alive(pgid):
            break
        time.sleep(0.1)
    return "killed"


def cmd_start(args: argparse.Namespace) -> int:
    from kvshare import launch

    http, grpc, metrics = (int(p) for p in args.ports.split(","))
    addr = launch.ServerAddress("127.0.0.1", http, grpc, metrics)
    # --exit-timeout-secs: after SIGINT, Triton waits this long for the models to unload (default 30).
    # Seen on the CPU machine: some stops after a streaming load never reach the model's finalize()
    # (Triton: "Found 1 live models", the stub idle) and sit out the whole timeout; nothing here
    # needs a graceful unload, and stop_group kills a stub that outlives the server.
    extra = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in args.models.split(",") if m),
             f"--exit-timeout-secs={args.exit_timeout}"]
    print(f"starting {launch.tritonserver_dir() / 'bin' / 'tritonserver'} on {args.repository} "
          f"(gRPC {addr.grpc_url}, metrics {addr.metrics_url}), log {args.log}", flush=True)
    env_shown = {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVSHARE_")}
    print(f"engine overrides: {env_shown}", flush=True)
    t0 = time.monotonic()
    proc = launch.start(Path(args.repository).resolve(), addr, log_path=Path(args.log), extra_args=extra)
    Path(args.pid_file).write_text(str(proc.pid))
    try:
        launch.wait_ready(proc, addr, timeout_s=args.ready_timeout)
    except BaseException as exc:
        print(f"server not ready: {exc}", file=sys.stderr, flush=True)
        stop_group(proc.pid, args.grace)
        try:
            print(Path(args.log).read_text(errors="replace")[-4000:], file=sys.stderr)
        except OSError:
            pass
        return 1
    print(f"READY after {time.monotonic() - t0:.1f} s (pid {proc.pid})", flush=True)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    try:
        pgid = int(Path(args.pid_file).read_text().strip())
    except (OSError, ValueError):
        print("no server pid file", flush=True)
        return 0
    t0 = time.monotonic()
    print(f"server {pgid}: {stop_group(pgid, args.grace)} in {time.monotonic() - t0:.1f} s", flush=True)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start")
    st.add_argument("--repository", default=str(ROOT / "model_repository"))
    st.add_argument("--ports", required=True, help="HTTP,GRPC,METRICS")
    st.add_argument("--models", default="llm_engine", help="comma-separated models to load")
    st.add_argument("--log", required=True)
    st.add_argument("--pid-file", required=True)
    st.add_argument("--ready-timeout", type=float, default=240.0)
    st.add_argument("--grace", type=float, default=30.0)
    st.add_argument("--exit-timeout", type=int, default=10, help="tritonserver --exit-timeout-secs")
    sp = sub.add_parser("stop")
    sp.add_argument("--pid-file", required=True)
    sp.add_argument("--grace", type=float, default=30.0)
    args = ap.parse_args(argv)
    return cmd_start(args) if args.cmd == "start" else cmd_stop(args)


if __name__ == "__main__":
    sys.exit(main())
