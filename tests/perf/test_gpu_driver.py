"""perf/gpu: the suites refer to files and modules that exist, the driver runs on the CPU (--help,
--list, a suite of its own with passing, failing, timed-out and skipped stages), and perf/results
holds only suites the driver has, under dated folders."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.gpu import __main__ as driver  # noqa: E402
from perf.gpu import env as gpu_env  # noqa: E402
from perf.gpu.suites import BY_NAME, SUITES, Stage, Suite  # noqa: E402

PATH_TOKEN = re.compile(r"(?:perf|tests)/[\w./-]+")


def referenced_paths(stage: Stage) -> list[str]:
    """Repo paths a stage's command names: scripts, test files (node ids cut), paths inside bash -c."""
    found = []
    for arg in stage.cmd:
        for m in PATH_TOKEN.finditer(arg):
            if not arg[:m.start()].endswith("{out}/"):     # a file the stage writes, not one of the repo's
                found.append(m.group().split("::")[0].rstrip("."))
    return found


def referenced_modules(stage: Stage) -> list[str]:
    cmd = list(stage.cmd)
    return [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == "-m"]


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_every_stage_names_files_and_modules_that_exist(suite):
    assert suite.stages and suite.minutes > 0 and suite.measures
    names = [s.name for s in suite.stages]
    assert len(set(names)) == len(names)
    for stage in suite.stages:
        assert stage.limit_s > 0 and re.fullmatch(r"[a-z0-9][a-z0-9-]*", stage.name)
        assert set(stage.needs) <= set(names[:names.index(stage.name)]), "a need runs before the stage"
        paths = referenced_paths(stage)
        scripts = [a for a in stage.cmd if a.endswith((".py", ".sh"))]
        assert set(scripts) <= set(paths)
        assert paths or referenced_modules(stage) or suite.carry, stage   # else it runs what is carried
        for p in paths:
            assert (ROOT / p).exists(), f"{suite.name}/{stage.name}: {p} does not exist"
        for m in referenced_modules(stage):
            assert importlib.util.find_spec(m) is not None, f"{suite.name}/{stage.name}: no module {m}"
        for w in stage.writes:
            assert not w.startswith("/") and ".." not in w


def test_test_node_ids_exist():
    for suite in SUITES:
        for stage in suite.stages:
            for arg in stage.cmd:
                if "::" in arg:
                    path, _, name = arg.partition("::")
                    assert f"def {name}(" in (ROOT / path).read_text(), arg


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "perf.gpu", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, **kw)


def test_help_and_list_work_on_the_cpu():
    h = run_cli("--help")
    assert h.returncode == 0 and "--list" in h.stdout and "--budget" in h.stdout
    r = run_cli("--list")
    assert r.returncode == 0, r.stderr
    for s in SUITES:
        assert re.search(rf"^{re.escape(s.name)}\s", r.stdout, re.M)
    d = run_cli("engine", "kernels", "--dry-run", "--out", "/tmp/kvshare-dry")
    assert d.returncode == 0 and "/tmp/kvshare-dry/engine/table.json" in d.stdout
    assert run_cli("no-such-suite").returncode == 2


def test_readme_table_is_the_drivers():
    """perf/README.md shows the table that `python -m perf.gpu --list --markdown` prints."""
    md = run_cli("--list", "--markdown").stdout.strip()
    assert md.splitlines()[0].startswith("| suite |")
    assert md in (ROOT / "perf" / "README.md").read_text()


def test_stage_env_puts_the_packages_first():
    env = gpu_env.stage_env({"PYTHONPATH": "/elsewhere"}, ROOT, ("/first",))
    parts = env["PYTHONPATH"].split(":")
    assert parts[0] == "/first" and parts[-1] == "/elsewhere"
    assert parts[1:5] == [str(ROOT / "backend"), str(ROOT / "kernels"), str(ROOT / "client"), str(ROOT)]
    assert env["PYTHONUNBUFFERED"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    out = subprocess.run([sys.executable, str(ROOT / "perf" / "gpu" / "env.py")], capture_output=True, text=True)
    assert "export PYTHONPATH=" in out.stdout


PY = "{python}"
FAKE = Suite("fake", "the driver itself", (
    Stage("ok", (PY, "-c", "import sys; print('hello'); print('50%|##| 5/10 [00:01<00:01, 3.2it/s]'); "
                 "open(sys.argv[1], 'w').write('{}')", "{out}/ok.json"), 30, ("ok.json",)),
    Stage("fails", (PY, "-c", "import os, sys; print(os.environ['KVX']); sys.exit(3)"), 30, ("never.json",),
          env=(("KVX", "{out}/x"),)),
    Stage("slow", (PY, "-c", "import time; print('start', flush=True); time.sleep(60)"), 1),
    Stage("after-fails", (PY, "-c", "print('not run')"), 30, needs=("fails",)),
    Stage("after-ok", (PY, "-c", "print('runs')"), 30, needs=("ok",)),
), minutes=0.1)


@pytest.fixture
def fake_suite(monkeypatch):
    monkeypatch.setitem(driver.BY_NAME, "fake", FAKE)
    return FAKE


def test_a_failing_or_slow_stage_does_not_stop_the_next(fake_suite, tmp_path, capsys):
    t0 = time.monotonic()
    rc = driver.main(["fake", "--out", str(tmp_path / "fake"), "--archive", str(tmp_path / "r.tar.gz")])
    assert time.monotonic() - t0 < 30 and rc == 1
    stages = {s["name"]: s for s in json.loads((tmp_path / "fake" / "stages.json").read_text())["stages"]}
    assert stages["ok"]["status"] == "passed" and stages["ok"]["written"] == ["ok.json"]
    assert stages["fails"]["status"] == "failed" and stages["fails"]["rc"] == 3
    assert stages["fails"]["missing"] == ["never.json"]
    assert stages["slow"]["status"] == "timeout" and stages["slow"]["rc"] == 124
    assert stages["after-fails"]["status"] == "skipped" and "fails" in stages["after-fails"]["reason"]
    assert stages["after-ok"]["status"] == "passed"
    log = (tmp_path / "fake" / "ok.log").read_text().splitlines()
    assert log[0].startswith("$ ") and log[1:] == ["hello"]           # the command, then the output sans tqdm
    assert str(tmp_path / "fake" / "x") in (tmp_path / "fake" / "fails.log").read_text()
    assert "start" in (tmp_path / "fake" / "slow.log").read_text()
    assert (tmp_path / "fake" / "gpu.txt").read_text().startswith("date ")
    printed = capsys.readouterr().out
    assert "[fake fails: failed rc=3" in printed and "[fake slow: timeout rc=124" in printed
    with tarfile.open(tmp_path / "r.tar.gz") as tar:
        assert {"fake/ok.json", "fake/stages.json", "fake/ok.log"} <= set(tar.getnames())


def test_only_and_budget(fake_suite, tmp_path):
    rc = driver.main(["fake", "--out", str(tmp_path / "a"), "--only", "ok,after-fails"])
    stages = {s["name"]: s for s in json.loads((tmp_path / "a" / "stages.json").read_text())["stages"]}
    assert rc == 0 and stages["ok"]["status"] == stages["after-fails"]["status"] == "passed"
    assert stages["fails"]["reason"] == "not selected"
    driver.main(["fake", "--out", str(tmp_path / "b"), "--budget", "1"])
    stages = json.loads((tmp_path / "b" / "stages.json").read_text())["stages"]
    assert all(s["status"] == "skipped" for s in stages)


DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


# Result folders of CPU commands (not GPU suites): folder -> the command that writes it.
CPU_RESULTS = {"soak": "python -m perf.load.soak", "cpu-decode-step": "python -m perf.engine.cpu_decode_step",
               "window-pages": "python perf/core/window_pages.py"}


def test_results_are_per_suite_and_date_and_the_readme_points_at_the_latest():
    results = ROOT / "perf" / "results"
    readme = (results / "README.md").read_text()
    for d in sorted(p for p in results.iterdir() if p.is_dir()):
        assert d.name in BY_NAME or d.name in CPU_RESULTS, f"perf/results/{d.name}: no such suite"
        dates = sorted(p.name for p in d.iterdir())
        assert dates and all(DATE.fullmatch(x) for x in dates), dates
        assert f"[`{d.name}/{dates[-1]}/`]({d.name}/{dates[-1]}/)" in readme, f"{d.name}: latest is {dates[-1]}"


NAMED_AFTER_THE_WORK = re.compile(r"session|(^|[-_/])(call|run)[-_]?\d|(^|[-_/])s[234]($|[-_/.])|validate_pending",
                                  re.I)


def test_no_path_is_named_after_how_the_work_was_organised():
    files = subprocess.run(["git", "ls-files", "perf", "tests/perf"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split()
    bad = [f for f in files if NAMED_AFTER_THE_WORK.search(f)]
    assert not bad, bad
