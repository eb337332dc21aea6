"""Runs benchmark suites on the GPU machine (perf/gpu/suites.py has them; perf/README.md the table).

    python3 -m perf.gpu --list                       # suite -> what it measures -> minutes -> files
    python3 -m perf.gpu kernels [engine ...] [--out DIR] [--only S1,S2] [--skip S] [--budget SECONDS]
    python3 -m perf.gpu engine --dry-run             # the commands, nothing run
    python3 -m perf.gpu peer --call 1 ... then --call 2 # a suite of several device commands, one each

From the repo root (the device runs a copy of the working tree there; nothing of ours is installed,
perf/gpu/env.py puts the packages on PYTHONPATH). Each suite writes into its folder: --out DIR
(one suite), else $OUT/<suite> when OUT is set (the device's folder that comes back), else
runs/gpu/<suite>-<time>. It gets gpu.txt (machine, versions), <stage>.log per stage (tqdm progress
lines dropped), the stages' own files and stages.json (each stage's command, status, exit code,
seconds, limit, files written or missing), rewritten after every stage. Every stage runs under its
own time limit (its process group is killed when it runs over: exit code 124); a stage whose
`needs` failed is skipped; another failing stage does not stop the next one. --budget caps the
whole run (each stage's limit shrinks to what is left; stages are skipped with < 15 s left).
Exit status 0 when every stage of every suite passed.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.gpu import env as gpu_env  # noqa: E402
from perf.gpu.suites import BY_NAME, SUITES, Stage, Suite  # noqa: E402

ROOT = gpu_env.ROOT
PROGRESS = re.compile(r"(it/s\]|s/it\]|\|\s*\d+/\d+ \[)")   # tqdm bars
MIN_STAGE_S = 15
KILL_GRACE_S = 10


@dataclass
class StageResult:
    name: str
    cmd: list[str]
    limit_s: int
    status: str = "pending"        # passed | failed | timeout | skipped
    rc: Optional[int] = None
    seconds: float = 0.0
    reason: str = ""
    written: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def fill(text: str, out: Path) -> str:
    return text.replace("{python}", sys.executable).replace("{out}", str(out))


def command(stage: Stage, out: Path) -> list[str]:
    return [fill(c, out) for c in stage.cmd]


def table(markdown: bool = False) -> str:
    """The suite table: suite, what it measures, what it writes, minutes."""
    if markdown:
        lines = ["| suite | what it measures | what it writes (besides gpu.txt, stages.json, <stage>.log) | minutes |",
                 "|---|---|---|---:|"]
        for s in SUITES:
            files = ", ".join(f"`{w}`" for s_ in s.stages for w in s_.writes) or "the logs"
            carry = f" (carry `{'`, `'.join(s.carry)}`)" if s.carry else ""
            lines.append(f"| `{s.name}`{carry} | {s.measures} | {files} | {s.minutes:g} |")
        return "\n".join(lines)
    out = []
    for s in SUITES:
        out.append(f"{s.name:<14} ~{s.minutes:g} min (limits {s.limit_s} s)  {s.measures}")
        for st in s.stages:
            out.append(f"    {st.name:<22} {st.limit_s:>4} s  {', '.join(st.writes) or '-'}")
        if s.carry and not s.calls:
            out.append(f"    carry: {', '.join(s.carry)}")
        for i, c in enumerate(s.calls, 1):
            out.append(f"    call {i}: {', '.join(c.stages)}; carry {', '.join(c.carry) or '-'}")
        if s.note:
            out.append(f"    note: {s.note}")
    return "\n".join(out)


def out_dir(suite: Suite, args: argparse.Namespace, several: bool) -> Path:
    if args.out:
        return Path(args.out).resolve() / suite.name if several else Path(args.out).resolve()
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]).resolve() / suite.name
    return ROOT / "runs" / "gpu" / f"{suite.name}-{dt.datetime.now():%Y-%m-%d-%H%M%S}"


def machine_info(out: Path, env: dict[str, str]) -> None:
    parts = [f"date {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC, host {os.uname().nodename}"]
    for cmd in (["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used",
                 "--format=csv"],
                [sys.executable, "-c", "import sys, torch, triton, transformers, numpy; print('python', "
                 "sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, "
                 "'transformers', transformers.__version__, 'numpy', numpy.__version__, 'cuda', "
                 "torch.cuda.is_available())"]):
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
            parts.append((r.stdout or r.stderr).strip())
        except (OSError, subprocess.TimeoutExpired) as exc:
            parts.append(f"{cmd[0]}: {exc}")
    (out / "gpu.txt").write_text("\n".join(p for p in parts if p) + "\n")


class Runner:
    def __init__(self, budget_s: Optional[float], tail: int, echo: bool):
        self.deadline = time.monotonic() + budget_s if budget_s else None
        self.tail = tail
        self.echo = echo
        self.current: Optional[subprocess.Popen] = None

    def left(self) -> Optional[float]:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def kill_current(self) -> None:
        p = self.current
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        except ProcessLookupError:
            pass

    def run_stage(self, stage: Stage, out: Path, base_env: dict[str, str]) -> StageResult:
        res = StageResult(stage.name, command(stage, out), stage.limit_s)
        limit = stage.limit_s
        left = self.left()
        if left is not None:
            if left < MIN_STAGE_S:
                res.status, res.reason = "skipped", "out of the --budget"
                return res
            limit = int(min(limit, left - 5))
        env = gpu_env.stage_env(base_env, ROOT, stage.python_path)
        env.update({k: fill(v, out) for k, v in stage.env})
        log = out / f"{stage.name}.log"
        t0 = time.monotonic()
        timed_out = threading.Event()
        with open(log, "w", encoding="utf-8", errors="replace") as f:
            f.write(f"$ {' '.join(res.cmd)}\n")
            f.flush()
            try:
                p = subprocess.Popen(res.cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
            except OSError as exc:
                res.status, res.rc, res.reason = "failed", 127, str(exc)
                f.write(f"{exc}\n")
                return res
            self.current = p

            def on_timeout() -> None:
                timed_out.set()
                self.kill_current()

            timer = threading.Timer(limit, on_timeout)
            timer.start()
            try:
                for raw in iter(p.stdout.readline, b""):
                    line = raw.decode("utf-8", errors="replace")
                    if PROGRESS.search(line.rsplit("\r", 1)[-1]):
                        continue
                    f.write(line)
                    if self.echo:
                        sys.stdout.write(line)
                p.wait()
            finally:
                timer.cancel()
                self.current = None
        res.seconds = round(time.monotonic() - t0, 1)
        res.rc = 124 if timed_out.is_set() else p.returncode
        res.status = "timeout" if timed_out.is_set() else ("passed" if p.returncode == 0 else "failed")
        if timed_out.is_set():
            res.reason = f"ran past its {limit} s"
        res.written = [w for w in stage.writes if (out / w).exists()]
        res.missing = [w for w in stage.writes if not (out / w).exists()]
        return res

    def show(self, suite: Suite, res: StageResult, out: Path) -> None:
        extra = f", missing {', '.join(res.missing)}" if res.missing and res.status != "skipped" else ""
        why = f" ({res.reason})" if res.reason else ""
        print(f"[{suite.name} {res.name}: {res.status} rc={res.rc}, {res.seconds:.0f} s of {res.limit_s}{why}{extra}]",
              flush=True)
        log = out / f"{res.name}.log"
        if self.tail and not self.echo and log.exists() and res.status != "skipped":
            lines = log.read_text(errors="replace").splitlines()[1:]
            n = self.tail if res.status == "passed" else max(self.tail, 15)
            for line in lines[-n:]:
                print(f"    {line[:220]}")
            sys.stdout.flush()


def run_suite(suite: Suite, out: Path, runner: Runner, only: set[str], skip: set[str],
              carry: Optional[Sequence[str]] = None) -> list[StageResult]:
    out.mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ)
    env = gpu_env.stage_env(base_env, ROOT)
    machine_info(out, env)
    missing_carry = [c for c in (suite.carry if carry is None else carry) if not (ROOT / c).exists()]
    results: list[StageResult] = []
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    print(f"== suite {suite.name} -> {out}" + (f" (not here: {', '.join(missing_carry)})" if missing_carry else ""),
          flush=True)

    # One of several device commands into the folder of an earlier one (on the warm machine): the
    # stages this command leaves out keep the earlier command's record, so stages.json covers all.
    earlier: dict[str, dict] = {}
    if carry is not None and (out / "stages.json").exists():
        try:
            earlier = {s["name"]: s for s in json.loads((out / "stages.json").read_text())["stages"]}
        except (ValueError, KeyError, TypeError):
            earlier = {}

    def save() -> None:
        (out / "stages.json").write_text(json.dumps({
            "suite": suite.name, "measures": suite.measures, "started": started,
            "python": sys.executable, "carry_missing": missing_carry,
            "stages": [earlier.get(r.name, r.__dict__) if r.reason == "not selected" else r.__dict__
                       for r in results]}, indent=1) + "\n")

    def selected(name: str) -> bool:      # a need left out by --only/--skip is not waited for
        return (not only or name in only) and name not in skip

    passed: set[str] = set()
    for stage in suite.stages:
        if (only and stage.name not in only) or stage.name in skip:
            res = StageResult(stage.name, command(stage, out), stage.limit_s, "skipped", reason="not selected")
        elif [n for n in stage.needs if n not in passed and selected(n)]:
            failed = [n for n in stage.needs if n not in passed and selected(n)]
            res = StageResult(stage.name, command(stage, out), stage.limit_s, "skipped",
                              reason=f"needs {', '.join(failed)}")
        else:
            res = runner.run_stage(stage, out, base_env)
        if res.status == "passed":
            passed.add(stage.name)
        results.append(res)
        save()
        if res.reason != "not selected":
            runner.show(suite, res, out)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m perf.gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suites", nargs="*", metavar="SUITE", help=f"any of: {', '.join(BY_NAME)}")
    ap.add_argument("--list", action="store_true", help="print the suites and exit")
    ap.add_argument("--markdown", action="store_true", help="with --list: the Markdown table of perf/README.md")
    ap.add_argument("--out", help="the suite's output folder (with several suites: DIR/<suite>)")
    ap.add_argument("--only", default="", help="comma-separated stage names to run (of each suite given)")
    ap.add_argument("--skip", default="", help="comma-separated stage names to leave out")
    ap.add_argument("--call", type=int, default=None, metavar="N",
                    help="of a suite run as several device commands (--list shows them): the stages of command N")
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS", help="cap on the whole run")
    ap.add_argument("--tail", type=int, default=6, help="lines of each stage's log to print after it (0: none)")
    ap.add_argument("--echo", action="store_true", help="print every stage's output as it comes")
    ap.add_argument("--archive", metavar="FILE.tar.gz", help="afterwards, pack every suite's folder into this "
                    "one file (the device returns at most 8 files: --archive $OUT/results.tar.gz)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    if args.list:
        print(table(args.markdown))
        return 0
    if not args.suites:
        ap.print_usage()
        print("no suite given; --list shows them", file=sys.stderr)
        return 2
    unknown = [s for s in args.suites if s not in BY_NAME]
    if unknown:
        ap.error(f"unknown suite {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    several = len(args.suites) > 1
    carry = None
    if args.call is not None:
        suite = BY_NAME[args.suites[0]]
        if several or not suite.calls:
            ap.error("--call needs one suite that is run as several device commands")
        if not 1 <= args.call <= len(suite.calls):
            ap.error(f"--call: {suite.name} has calls 1..{len(suite.calls)}")
        if only:
            ap.error("--call and --only: give one of them")
        call = suite.calls[args.call - 1]
        only, carry = set(call.stages), call.carry
    if args.dry_run:
        for name in args.suites:
            suite = BY_NAME[name]
            out = out_dir(suite, args, several)
            print(f"== suite {name} -> {out}")
            for st in suite.stages:
                if (only and st.name not in only) or st.name in skip:
                    continue
                env = " ".join(f"{k}={fill(v, out)}" for k, v in st.env)
                print(f"  [{st.name}, {st.limit_s} s{', needs ' + ','.join(st.needs) if st.needs else ''}] "
                      f"{env + ' ' if env else ''}{' '.join(command(st, out))}")
        return 0

    runner = Runner(args.budget, args.tail, args.echo)

    def on_signal(signum, _frame):
        runner.kill_current()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ok = True
    summary = []
    for name in args.suites:
        suite = BY_NAME[name]
        out = out_dir(suite, args, several)
        results = run_suite(suite, out, runner, only, skip, carry)
        ok &= all(r.status in ("passed",) or r.reason == "not selected" for r in results)
        summary.append((name, out, results))
    print("== summary")
    for name, out, results in summary:
        states = ", ".join(f"{r.name} {r.status}" for r in results if r.reason != "not selected")
        print(f"  {name}: {states}  ({out})")
    if args.archive:
        archive(Path(args.archive), [out for _, out, _ in summary])
    return 0 if ok else 1


def archive(path: Path, folders: Sequence[Path]) -> None:
    """One .tar.gz of the suites' folders, each under its own name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for folder in folders:
            tar.add(folder, arcname=folder.name)
    print(f"archive {path} ({path.stat().st_size / 1e6:.1f} MB): {', '.join(f.name for f in folders)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
