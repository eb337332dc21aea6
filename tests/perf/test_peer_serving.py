"""perf/peer/serving.py and serving_report.py: the points, the commands both servers' loads get,
the suite's four calls, and the table, goal readings and plot on hand-made results. (The kvshare
side's driver was run against the real CPU server by hand; vLLM does not run on this machine.)"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.core.workload_traces import make_trace  # noqa: E402
from perf.gpu.suites import BY_NAME  # noqa: E402
from perf.peer import serving, serving_report  # noqa: E402


def test_points_fit_their_traces_and_the_context():
    for p in serving.POINTS:
        reqs = make_trace(p.trace).requests
        assert len(reqs) >= p.requests, p.name
        assert max(len(r.prompt_ids) + r.max_new_tokens for r in reqs[: p.requests]) <= serving.MAX_MODEL_LEN
    offsets = [serving.id_offset(i) for i in range(len(serving.POINTS))]
    assert len(set(offsets)) == len(offsets) and serving.id_offset(-1) == 0      # the warm-up's own ids
    with pytest.raises(ValueError, match="exactly one"):
        serving.ServingPoint("x", "mixed", 1, concurrency=1, rate=2.0)


def test_the_long_mixed_trace_starts_with_the_mixed_trace():
    short, long = make_trace("mixed").requests, make_trace("mixed-1k").requests
    assert len(long) == 1000 and [(r.prompt_ids, r.max_new_tokens) for r in long[: len(short)]] == \
        [(r.prompt_ids, r.max_new_tokens) for r in short]


def test_both_servers_get_the_same_load_but_the_target():
    p = serving.BY_NAME["mixed-r16"]
    k = serving.load_command("py", "triton", "h:1", "llm_engine", p, 4, Path("/o"))
    v = serving.load_command("py", "openai", "http://h:2", "llama-2-7b", p, 4, Path("/o"))
    differ = {i for i, (a, b) in enumerate(zip(k, v)) if a != b}
    assert len(k) == len(v) and {k[i] for i in differ} == {"triton", "h:1", "llm_engine"}
    assert k[k.index("--rate") + 1] == "16.0" and k[k.index("--processes") + 1] == "2"
    assert k[k.index("--id-offset") + 1] == str(serving.id_offset(4))
    cmd = serving.vllm_command("python3", Path("/m"), 8000)
    assert cmd[cmd.index("--max-num-seqs") + 1] == str(serving.MAX_RUNNING) and "--skip-tokenizer-init" in cmd
    assert serving.kvshare_env()["KVSHARE_MAX_RUNNING"] == str(serving.MAX_RUNNING)
    assert serving.kvshare_env()["KVSHARE_MAX_MODEL_LEN"] == cmd[cmd.index("--max-model-len") + 1]


def test_processes_override_every_selected_point_and_keeps_their_ids():
    points = serving.selected("mixed-c64,mixed-c1", processes=8)
    assert [(p.name, p.processes) for p in points] == [("mixed-c64", 8), ("mixed-c1", 8)]
    assert serving.selected("", None) == serving.POINTS and serving.selected("mixed-c16")[0].processes == 2
    for bad in (dict(names="nope"), dict(names="mixed-c1", processes=0)):
        with pytest.raises(SystemExit, match="points|processes"):
            serving.selected(bad["names"], bad.get("processes"))


def test_the_suite_runs_both_servers_then_the_kernels_in_five_calls():
    s = BY_NAME["peer-serving"]
    stages = {st.name: st for st in s.stages}
    assert [c.stages for c in s.calls] == [("env", "kvshare", "keep-kvshare"),
                                           ("stage-piece1", "kvshare-in-stub", "keep-kvshare-in-stub"),
                                           ("unpack", "vllm", "serving", "serving-in-stub"),
                                           ("prefill-ceiling", "decode-page16"), ("kernels", "prefill-sweep")]
    assert s.calls[0].carry == (".carry/fullstack",) and ".carry/vllm/p2" in s.calls[2].carry
    assert "--load-env" in stages["vllm"].cmd and stages["vllm"].needs == ("unpack",)
    # both engine modes in one lease, each with its own table beside the same vllm serve run
    assert dict(stages["kvshare"].env)["KVSHARE_ENGINE_PROCESS"] == "on"
    assert dict(stages["kvshare-in-stub"].env)["KVSHARE_ENGINE_PROCESS"] == "off"
    kept = [stages["serving"].cmd[stages["serving"].cmd.index("--kvshare") + 1],
            stages["serving-in-stub"].cmd[stages["serving-in-stub"].cmd.index("--kvshare") + 1]]
    assert len(set(kept)) == 2 and all(k in " ".join(stages[f"keep-{n}"].cmd) for k, n in
                                       zip(kept, ("kvshare", "kvshare-in-stub")))
    assert all(st.limit_s <= 540 for st in s.stages)
    for c in s.calls:   # each call is one device command of at most 10 minutes
        assert sum(stages[n].limit_s for n in c.stages) <= 590, c


def test_env_python_reads_activate_sh(tmp_path):
    (tmp_path / "activate.sh").write_text("PY=/tmp/env/bin/python\nPA=/x/perf_analyzer\n")
    assert serving.env_python(tmp_path) == "/tmp/env/bin/python"
    (tmp_path / "activate.sh").write_text("PA=x\n")
    with pytest.raises(SystemExit):
        serving.env_python(tmp_path)


def _summary(tok, ttft99, errors=0, ttft50=None, itl50=5.0, whole=None):
    """tok: the sustained tok/s; the whole run's is `whole` (default: half of it, as a drain makes it)."""
    return {"summary": dict(sustained_tok_per_s=tok, tok_per_s=whole or tok / 2, ttft_p50_ms=ttft50 or ttft99 / 2,
                            ttft_p99_ms=ttft99, itl_p50_ms=itl50, itl_p99_ms=3 * itl50, errors=errors)}


def test_report_table_goals_and_plot(tmp_path):
    k, v = tmp_path / "k", tmp_path / "v"
    k.mkdir(), v.mkdir()
    # vLLM: 1,000 tok/s at 200 ms, 2,000 at 900 ms, 2,400 at 5 s; kvshare: 1,000 at 150, 2,000 at 300, 3,000 at 800
    for name, ((kt, k99), (vt, v99)) in {"mixed-r8": ((1000, 150), (1000, 200)), "mixed-r16": ((2000, 300), (2000, 900)),
                                       "mixed-r32": ((3000, 800), (2400, 5000))}.items():
        (k / f"{name}.json").write_text(json.dumps(_summary(kt, k99)))
        (v / f"{name}.json").write_text(json.dumps(_summary(vt, v99)))
    # the drain paced both alike: whole runs level while the sustained rates differ
    (k / "mixed-r32.json").write_text(json.dumps(_summary(3000, 800, whole=1900)))
    (v / "mixed-r32.json").write_text(json.dumps(_summary(2400, 5000, whole=1900)))
    (k / "mixed-c16.json").write_text(json.dumps(_summary(1500, 100)))
    (v / "mixed-c16.json").write_text(json.dumps(_summary(1200, 120, errors=2)))
    md, js, png = tmp_path / "s.md", tmp_path / "s.json", tmp_path / "s.png"
    assert serving_report.main(["--kvshare", str(k), "--vllm", str(v), "--md", str(md), "--json", str(js),
                                "--png", str(png), "--info", "machine X"]) == 0
    data = json.loads(js.read_text())
    by_point = {r["point"]: r for r in data["points"]}
    assert list(by_point) == ["mixed-c16", "mixed-r8", "mixed-r16", "mixed-r32"]     # the suite's order
    assert by_point["mixed-r32"]["ratio"] == pytest.approx(1.25)
    assert by_point["mixed-r32"]["ratio_whole_run"] == pytest.approx(1.0)
    goals = {g["rate"]: g for g in data["goals"]}
    # within vLLM's 900 ms at 16/s: kvshare reaches 3,000 (800 ms), vLLM 2,000 -> 1.5x
    assert goals[16.0]["kvshare_tok_s"] == 3000 and goals[16.0]["vllm_tok_s"] == 2000
    assert goals[16.0]["throughput_ratio"] == pytest.approx(1.5) and goals[16.0]["ttft_p99_ratio"] == pytest.approx(1 / 3)
    assert goals[8.0]["throughput_ratio"] == pytest.approx(1.0)
    text = md.read_text()
    assert "| mixed-r32 | 32/s | 3,000 / 2,400 | 1.25× | 1,900 / 1,900 | 1.00× |" in text and "machine X" in text
    assert "| 0 / 2 |" in text                          # vLLM's errors at c=16 are shown
    assert png.stat().st_size > 10_000


def test_report_refuses_two_empty_folders(tmp_path):
    assert serving_report.main(["--kvshare", str(tmp_path), "--vllm", str(tmp_path)]) == 1


def test_serving_points_variable_sets_the_default_points(monkeypatch):
    monkeypatch.setenv("SERVING_POINTS", "mixed-c1,mixed-r64")
    out = []
    monkeypatch.setattr(serving, "cmd_plan", lambda args: out.append(args.points) or 0)
    assert serving.main(["plan"]) == 0 and out == ["mixed-c1,mixed-r64"]


def test_late_compiles_are_the_cache_files_written_after_ready_each_with_its_point(tmp_path):
    import os

    def compiled(name, at):
        path = tmp_path / name[:3] / f"{name}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text("{}")
        os.utime(path, (at, at))

    compiled("_prefill_kernel", 90.0)           # at start-up, before ready
    compiled("_rotary_kernel", 101.0)           # in the warm-up
    compiled("_copy_pages_kernel", 125.5)       # in a point
    compiled("__grp___copy_pages_kernel", 125.5)
    compiled("_decode_split_kernel", 140.0)     # between points
    spans = [("warmup", 100.0, 102.0), ("mixed-c64", 110.0, 121.0), ("mixed-r32", 122.0, 139.0)]
    late = serving.late_compiles(tmp_path, 100.0, spans)
    assert late == [{"kernel": "_rotary_kernel", "after_ready_s": 1.0, "during": "warmup"},
                    {"kernel": "_copy_pages_kernel", "after_ready_s": 25.5, "during": "mixed-r32"},
                    {"kernel": "_decode_split_kernel", "after_ready_s": 40.0, "during": "between points"}]


def test_kvshare_pool_fits_what_vllm_leaves_for_kv_on_any_gpu():
    assert serving.kv_gb(None) == serving.KV_GB                  # the H200 runs keep their 100 GB pool
    assert serving.kv_gb(150.1) == serving.KV_GB
    assert serving.kv_gb(85.5) == 56.0                           # an H100 80GB: 0.9 x 85.5 - 20
    assert serving.kvshare_env(85.5)["KVSHARE_KV_CACHE_MEMORY_GB"] == "56"
