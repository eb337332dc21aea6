"""perf/peer: both sides run the same rows (traces, request counts, requests in flight), the `peer`
suite's two device commands cover every row, vLLM's runner plans its engine without vLLM, and the
ratio table is right on hand-made JSON of both sides."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.core import workload_traces as wt  # noqa: E402
from perf.engine.offline_benchmark import parse_workload  # noqa: E402
from perf.gpu import __main__ as driver  # noqa: E402
from perf.gpu.suites import BY_NAME, PEER_KEEP  # noqa: E402
from perf.peer import ratio_table, rows, vllm_offline  # noqa: E402

from kvshare.runtime.model_config import NAMED_CONFIGS  # noqa: E402


def test_every_row_is_its_traces_shape():
    for r in rows.ROWS:
        trace = wt.make_trace(r.workload)
        assert r.requests <= len(trace.requests)
        if r.open_loop:
            assert r.max_num_seqs == r.requests
        else:   # kvshare's closed loop keeps trace.concurrency in flight; vLLM's max_num_seqs must match
            assert r.max_num_seqs == trace.concurrency, r
        window = r.max_model_len or NAMED_CONFIGS[r.model].max_position
        assert window <= NAMED_CONFIGS[r.model].max_position
        longest = max(len(q.prompt_ids) + q.max_new_tokens for q in trace.requests[: r.requests])
        assert longest <= window, f"{r.workload}: {longest} tokens do not fit a {window}-token context"


def test_seed_long_32k_trace():
    t = wt.make_trace("seed-long-32k")
    assert t.concurrency == 8 and len(t.requests) == 8
    assert {len(r.prompt_ids) for r in t.requests} == {32_768} and {r.max_new_tokens for r in t.requests} == {256}
    assert len({r.prompt_ids[:16] for r in t.requests}) == 8          # distinct from the first page on
    assert t.requests == wt.make_trace("seed-long-32k").requests      # seeded
    c = NAMED_CONFIGS["llama-3.1-8b"]
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == (32, 32, 8, 14336, 128256)
    assert c.max_position == 131072 and dict(c.rope_parameters)["rope_type"] == "llama3"


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match="model"):
        rows.PeerRow("fixed-1", 2, 1, model="gpt-2")
    with pytest.raises(ValueError, match="open-loop"):
        rows.PeerRow("shared-prefix", 256, 64, open_loop=True)
    with pytest.raises(ValueError, match="unknown nope"):
        rows.rows_named(["fixed-1", "nope"])


def _arg(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_the_suite_runs_every_row_on_both_sides_in_its_first_three_calls():
    suite = BY_NAME["peer"]
    names = [s.name for s in suite.stages]
    assert len(suite.calls) == 4
    assert [n for c in suite.calls for n in c.stages] == names             # the calls split the stages, in order
    by = {s.name: s for s in suite.stages}
    for i, call in enumerate(suite.calls):
        assert set(call.carry) <= set(suite.carry)
        for n in call.stages:
            earlier = {m for c in suite.calls[:i + 1] for m in c.stages}
            assert set(by[n].needs) <= earlier, "a need runs in the same command or an earlier one"
    assert ".carry/vllm/p1" in suite.calls[0].carry and ".carry/vllm/p2" in suite.calls[1].carry
    kvshare, vllm = {}, {}
    for n in suite.calls[0].stages:
        cmd = by[n].cmd
        if "perf/engine/offline_benchmark.py" in cmd and "--page-size" not in cmd:
            for spec in _arg(cmd, "--workloads").split(","):
                name, requests, baselines = parse_workload(spec, None, ["generate"])
                assert baselines == [] and _arg(cmd, "--baselines") == ""
                kvshare[name] = (requests, _arg(cmd, "--model"), int(_arg(cmd, "--repeat")), "--open-loop" in cmd)
    for n in (*suite.calls[1].stages, *suite.calls[2].stages):
        cmd = by[n].cmd
        if "perf.peer.vllm_offline" in cmd:
            assert by[n].python_path == ("/tmp/site",) and by[n].needs in (("unpack",), ())
            for name in _arg(cmd, "--rows").split(","):
                vllm[name] = n
    assert set(kvshare) == set(vllm) == {r.workload for r in rows.ROWS}
    for r in rows.ROWS:
        assert kvshare[r.workload] == (r.requests, f"dummy:{r.model}", r.repeat, r.open_loop)
    assert len(set(vllm.values())) == len({r.engine for r in rows.ROWS})   # one vLLM engine per setting
    keep, table = by["keep"].cmd[-1], by["table"].cmd
    assert PEER_KEEP in keep and _arg(table, "--kvshare") == PEER_KEEP


def test_every_kvshare_row_runs_again_at_larger_pages_beside_the_same_vllm_rows():
    suite = BY_NAME["peer"]
    by = {s.name: s for s in suite.stages}
    default = {n: by[n].cmd for n in suite.calls[0].stages
               if "perf/engine/offline_benchmark.py" in by[n].cmd and "--page-size" not in by[n].cmd}
    for call, page in ((suite.calls[0], "128"), (suite.calls[3], "64")):
        paged = {n: by[n].cmd for n in call.stages if n.endswith(f"-page{page}") and "--page-size" in by[n].cmd}
        assert {n.removesuffix(f"-page{page}") for n in paged} == set(default)
        for n, cmd in paged.items():
            assert _arg(cmd, "--page-size") == page and _arg(cmd, "--json").startswith(f"{{out}}/page{page}/")
            base = default[n.removesuffix(f"-page{page}")]
            assert _arg(cmd, "--workloads") == _arg(base, "--workloads") and _arg(cmd, "--model") == _arg(base, "--model")
    # each call may get a fresh OUT: the last table reads vLLM's rows where call 3 kept them
    last = by["table-pages"].cmd
    assert _arg(last, "--vllm") == PEER_KEEP and "keep-vllm" in suite.calls[2].stages
    assert [a for a in last if a.startswith("page ")] == [f"page 128={PEER_KEEP}/page128", f"page 64={PEER_KEEP}/page64",
                                                          f"page 128, 16k-token steps={PEER_KEEP}/page128-steps16k"]
    steps = by["kvshare-8b-page128-steps16k"].cmd            # the 32k row with vLLM's step size
    assert _arg(steps, "--max-step-tokens") == "16384" and _arg(steps, "--workloads") == "seed-long-32k:8:"
    assert "{out}/page128-steps16k" in by["keep-page64"].cmd[-1]


def test_driver_runs_one_call_of_the_suite(capsys):
    assert driver.main(["peer", "--call", "2", "--dry-run", "--out", "/tmp/kvshare-peer-dry"]) == 0
    out = capsys.readouterr().out
    assert "[unpack," in out and "perf.peer.vllm_offline --rows seed-12x128,seed-long" in out
    assert "offline_benchmark" not in out and "[table," not in out
    assert driver.main(["peer", "--call", "3", "--dry-run", "--out", "/tmp/kvshare-peer-dry"]) == 0
    out = capsys.readouterr().out
    assert "perf.peer.vllm_offline --rows fixed-256,shared-prefix" in out and "[table," in out
    for bad in (["engine", "--call", "1"], ["peer", "--call", "5"], ["peer", "--call", "1", "--only", "keep"]):
        with pytest.raises(SystemExit):
            driver.main([*bad, "--dry-run"])


def test_a_later_call_keeps_the_earlier_calls_record(tmp_path, monkeypatch):
    from perf.gpu.suites import Call, Stage, Suite

    py = "{python}"
    two = Suite("two", "two commands", (Stage("first", (py, "-c", "print(1)"), 30),
                                        Stage("second", (py, "-c", "import sys; sys.exit(2)"), 30)),
                minutes=0.1, carry=("nothere-a", "nothere-b"),
                calls=(Call(("first",), ("nothere-a",)), Call(("second",), ("nothere-b",))))
    monkeypatch.setitem(driver.BY_NAME, "two", two)
    monkeypatch.setattr(driver, "machine_info", lambda out, env: (out / "gpu.txt").write_text("here\n"))
    assert driver.main(["two", "--call", "1", "--out", str(tmp_path)]) == 0
    assert driver.main(["two", "--call", "2", "--out", str(tmp_path)]) == 1
    record = json.loads((tmp_path / "stages.json").read_text())
    assert [(s["name"], s["status"]) for s in record["stages"]] == [("first", "passed"), ("second", "failed")]
    assert record["carry_missing"] == ["nothere-b"]


def test_vllm_runner_plans_one_engine_without_vllm(tmp_path):
    r = subprocess.run([sys.executable, "-m", "perf.peer.vllm_offline", "--rows", "seed-long-32k", "--plan",
                        "--model-root", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    e = plan["engine"]
    assert (e["max_num_seqs"], e["max_model_len"], e["load_format"], e["dtype"]) == (8, 33024, "dummy", "float16")
    assert e["skip_tokenizer_init"] and e["disable_log_stats"] is False
    assert "vllm" not in sys.modules
    cfg = json.loads((tmp_path / "llama-3.1-8b-dummy" / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["max_position_embeddings"] == 131072
    assert cfg["num_key_value_heads"] == 8 and cfg["intermediate_size"] == 14336
    two = subprocess.run([sys.executable, "-m", "perf.peer.vllm_offline", "--rows", "fixed-1,fixed-64", "--plan"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert two.returncode == 2 and "more than one engine" in two.stderr


def test_vllm_config_reads_back_as_kvshares_shape(tmp_path):
    transformers = pytest.importorskip("transformers")
    for name in ("llama-2-7b", "llama-3.1-8b"):
        hf = transformers.AutoConfig.from_pretrained(vllm_offline.model_dir(name, "float16", tmp_path))
        from kvshare.runtime.model_config import ModelConfig

        back = ModelConfig.from_hf(hf)
        want = NAMED_CONFIGS[name]
        assert (back.num_layers, back.hidden_size, back.intermediate_size, back.num_heads, back.num_kv_heads,
                back.head_dim, back.vocab_size, back.max_position, back.rope_theta) == (
            want.num_layers, want.hidden_size, want.intermediate_size, want.num_heads, want.num_kv_heads,
            want.head_dim, want.vocab_size, want.max_position, want.rope_theta)
        assert dict(back.rope_parameters).get("rope_type", "default") == dict(want.rope_parameters).get(
            "rope_type", "default")


def test_warm_up_prompts_share_no_page_with_the_timed_ones():
    for r in rows.ROWS:
        timed, warm, outs = vllm_offline.token_prompts(r, NAMED_CONFIGS[r.model].vocab_size)
        assert len(timed) == len(outs) == r.requests and len(warm) == min(r.requests, r.max_num_seqs, 64)
        first_pages = {tuple(p[:16]) for p in timed}
        assert not first_pages & {tuple(p[:16]) for p in warm}


def _run(tok_s, sched=10.0, arrival=90.0):
    return vllm_offline.Run(100, 100 / tok_s, tok_s, sched, sched, arrival, arrival, 0.0, True)


def test_vllm_row_is_the_median_run_on_its_own_ttft_basis():
    closed = rows.BY_WORKLOAD["seed-12x128"]
    rec = vllm_offline.row_record(closed, [_run(300, 1), _run(100, 2), _run(200, 3)], "vllm-x", {})
    assert rec["tok_per_s"] == 200 and rec["ttft_p50_ms"] == 3 and rec["ttft_basis"] == "scheduled"
    assert rec["runs_tok_per_s"] == [300, 100, 200]
    opened = rows.BY_WORKLOAD["shared-prefix"]
    rec = vllm_offline.row_record(opened, [_run(50, 1, 700)], "vllm-x", {})
    assert rec["ttft_p50_ms"] == 700 and rec["ttft_basis"] == "arrival" and rec["runs_tok_per_s"] is None
    assert vllm_offline.pct_ms([0.1, 0.2, 0.3, 0.4], 0.5) == pytest.approx(300.0)


def _kv(workload, system, tok_s, ttft=20.0, runs=None):
    return dict(workload=workload, system=system, requests=rows.BY_WORKLOAD[workload].requests, output_tokens=1,
                seconds=1.0, tok_per_s=tok_s, ttft_p50_ms=ttft, ttft_p95_ms=ttft, peak_kv_pages=1,
                prefix_hit_rate=0.0, runs_tok_per_s=runs)


def test_ratio_table_on_hand_made_json(tmp_path):
    (tmp_path / "kv").mkdir()
    (tmp_path / "vl").mkdir()
    kv = [_kv(r.workload, "kvshare", 1000.0 * (i + 1), runs=[900.0, 1000.0, 1100.0]) for i, r in enumerate(rows.ROWS)
          if r.workload != "shared-prefix"]
    kv += [_kv("shared-prefix", "kvshare-no-sharing (cache_aware, delay 0)", 1.0),
           _kv("shared-prefix", "kvshare (cache_aware, delay 0)", 4250.0, ttft=2400.0)]
    (tmp_path / "kv" / "kvshare-7b.json").write_text(json.dumps(kv))
    engine = {"vllm": "0.25.0", "device": "NVIDIA H200", "torch": "2.11.0+cu130"}
    vl = [dict(_kv(r.workload, "vllm-0.25.0", 800.0), ttft_basis="arrival" if r.open_loop else "scheduled",
               model=r.model, max_num_seqs=r.max_num_seqs, engine=engine) for r in rows.ROWS if r.workload != "seed-long-32k"]
    vl[-1]["tok_per_s"] = 2750.0                                         # shared-prefix
    (tmp_path / "vl" / "vllm-7b.json").write_text(json.dumps(vl))
    md_path, js_path = tmp_path / "t.md", tmp_path / "t.json"
    rc = ratio_table.main(["--kvshare", str(tmp_path / "kv"), "--vllm", str(tmp_path / "vl"),
                           "--md", str(md_path), "--json", str(js_path)])
    assert rc == 1                                                       # seed-long-32k has no vLLM row
    md = md_path.read_text()
    assert "vLLM 0.25.0 on NVIDIA H200" in md
    assert "| fixed-1 | llama-2-7b, 2, 1 | 1,000 | 800 | 1.25× | 20 | 20 | 3 runs, 20%; 1 run |" in md
    assert "| shared-prefix | llama-2-7b, 256, all at once | 4,250 | 2,750 | 1.55× | 2,400 | 20 (from arrival) |" in md
    assert "| seed-long-32k | llama-3.1-8b, 8, 8 | 7,000 | — |  | 20 | — | 3 runs, 20%; — |" in md
    assert "Incomplete: seed-long-32k (no vLLM row)" in md
    data = json.loads(js_path.read_text())
    by = {r["workload"]: r for r in data["comparison"]}
    assert [r["workload"] for r in data["comparison"]] == [r.workload for r in rows.ROWS]
    assert by["fixed-64"]["ratio"] == pytest.approx(4000 / 800)
    assert by["shared-prefix"]["kvshare_system"] == "kvshare (cache_aware, delay 0)"
    assert len(data["kvshare"]) == len(kv) and len(data["vllm"]) == len(vl)
    # a row run with other engine settings stands beside vLLM's row of its workload
    (tmp_path / "p128.json").write_text(json.dumps([_kv("fixed-64", "kvshare", 1600.0)]))
    ratio_table.main(["--kvshare", str(tmp_path / "kv"), "--vllm", str(tmp_path / "vl"), "--md", str(md_path),
                      "--variant", f"page 128={tmp_path / 'p128.json'}", "--variant", f"gone={tmp_path / 'none.json'}"])
    md = md_path.read_text()
    assert "| fixed-64 (page 128) | llama-2-7b, 128, 64 | 1,600 | 800 | 2.00× |" in md and "(gone)" not in md
    (tmp_path / "p64").mkdir()                                          # a folder's kvshare-*.json
    (tmp_path / "p64" / "kvshare-7b.json").write_text(json.dumps([_kv("fixed-64", "kvshare", 1200.0)]))
    ratio_table.main(["--kvshare", str(tmp_path / "kv"), "--vllm", str(tmp_path / "vl"), "--md", str(md_path),
                      "--variant", f"page 64={tmp_path / 'p64'}"])
    assert "| fixed-64 (page 64) | llama-2-7b, 128, 64 | 1,200 | 800 | 1.50× |" in md_path.read_text()
    with pytest.raises(SystemExit):
        ratio_table.main(["--kvshare", str(tmp_path / "kv"), "--vllm", str(tmp_path / "vl"), "--variant", "nolabel"])
    full = [dict(vl[0], workload="seed-long-32k", requests=8, model="llama-3.1-8b")]
    (tmp_path / "vl" / "vllm-8b.json").write_text(json.dumps(full))
    assert ratio_table.main(["--kvshare", str(tmp_path / "kv"), "--vllm", str(tmp_path / "vl")]) == 0
    with pytest.raises(SystemExit):
        ratio_table.main(["--kvshare", str(tmp_path / "nothing"), "--vllm", str(tmp_path / "vl")])
