"""kvshare's and vLLM's rows of one lease as one Markdown table: tok/s both sides, the ratio, TTFT p50.

    python -m perf.peer.ratio_table --kvshare /tmp/kvshare-peer --vllm OUT/peer --md OUT/peer/table.md \
        --json OUT/peer/peer.json

--kvshare takes perf/engine/offline_benchmark.py's JSON (files, or folders whose kvshare-*.json are
read), --vllm perf/peer/vllm_offline.py's (files, or folders' vllm-*.json). A workload's kvshare row
is the one labelled `kvshare` (engine settings in brackets allowed), not `kvshare-no-sharing`. Rows
come in perf/peer/rows.py's order. Exit status 1 when a row of ROWS lacks a side (the table is still
written with what there is), so a suite stage says the comparison is incomplete.

--variant "page 128=PATH": kvshare's rows in PATH (a file, or a folder's kvshare-*.json), run with other
engine settings, each as a row "<workload> (page 128)" beside vLLM's row of that workload (a missing
PATH is reported, not fatal).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.peer.rows import BY_WORKLOAD, ROWS  # noqa: E402

Row = dict[str, Any]


def json_files(paths: Iterable[Path], prefix: str) -> list[Path]:
    found: list[Path] = []
    for p in paths:
        if p.is_dir():
            found += sorted(p.glob(f"{prefix}-*.json"))
        elif p.exists():
            found.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    return found


def read_rows(files: Sequence[Path]) -> list[Row]:
    rows: list[Row] = []
    for f in files:
        data = json.loads(f.read_text())
        if not isinstance(data, list):
            raise ValueError(f"{f}: expected a JSON list of rows")
        rows += data
    return rows


def is_kvshare(row: Row) -> bool:
    return row.get("system", "").partition(" (")[0] == "kvshare"


def pick(rows: Sequence[Row], keep) -> dict[str, Row]:
    """workload -> its last row that `keep` accepts (a later file's row replaces an earlier one)."""
    return {r["workload"]: r for r in rows if keep(r)}


def spread(row: Row | None) -> str:
    """The run count and (max - min) / median of a row's runs."""
    if row is None:
        return "—"
    runs = row.get("runs_tok_per_s") or []
    if len(runs) < 2:
        return "1 run"
    mid = sorted(runs)[(len(runs) - 1) // 2]
    return f"{len(runs)} runs, {100 * (max(runs) - min(runs)) / mid:.0f}%"


def comparison(kvshare: Sequence[Row], vllm: Sequence[Row],
               variants: dict[str, Sequence[Row]] | None = None) -> tuple[list[Row], list[str]]:
    """One record per workload (ROWS order, then any other workload either side has, then each
    variant's workloads as "<workload> (<label>)" against vLLM's row of the workload) and, for each
    workload of ROWS that lacks a side, which."""
    kv = pick(kvshare, is_kvshare)
    vl = pick(vllm, lambda r: r.get("system", "").startswith("vllm"))
    names = [r.workload for r in ROWS] + sorted((set(kv) | set(vl)) - set(BY_WORKLOAD))
    pairs = [(name, kv.get(name), vl.get(name)) for name in names]
    for label, rows in (variants or {}).items():
        pairs += [(f"{w} ({label})", k, vl.get(w)) for w, k in pick(rows, is_kvshare).items()]
    records, missing = [], []
    for name, k, v in pairs:
        if not (k and v):
            if name in BY_WORKLOAD:
                missing.append(f"{name} (no {' or '.join(s for s, x in (('kvshare', k), ('vLLM', v)) if not x)} row)")
            if not (k or v):
                continue
        spec = BY_WORKLOAD.get(name.partition(" (")[0])
        records.append(dict(
            workload=name, model=spec.model if spec else (v or {}).get("model"),
            requests=(k or v)["requests"], max_num_seqs=spec.max_num_seqs if spec else (v or {}).get("max_num_seqs"),
            open_loop=spec.open_loop if spec else None,
            kvshare_tok_s=k["tok_per_s"] if k else None, vllm_tok_s=v["tok_per_s"] if v else None,
            ratio=k["tok_per_s"] / v["tok_per_s"] if k and v else None,
            kvshare_ttft_p50_ms=k.get("ttft_p50_ms") if k else None,
            vllm_ttft_p50_ms=v.get("ttft_p50_ms") if v else None, vllm_ttft_basis=v.get("ttft_basis") if v else None,
            kvshare_runs=spread(k), vllm_runs=spread(v),
            kvshare_system=k["system"] if k else None, vllm_system=v["system"] if v else None))
    return records, missing


def _num(v: float | None, fmt: str = ",.0f") -> str:
    return "—" if v is None else format(v, fmt)


def markdown(records: Sequence[Row], missing: Sequence[str], vllm: Sequence[Row]) -> str:
    info = next((r["engine"] for r in vllm if r.get("engine")), {})
    head = (f"kvshare vs vLLM {info.get('vllm', '?')} on {info.get('device', '?')} (torch {info.get('torch', '?')}), "
            "one lease; random weights, fp16, greedy, EOS ignored; tok/s = output tokens / wall s")
    lines = [head, "",
             "| workload | model, requests, in flight | kvshare tok/s | vLLM tok/s | kvshare / vLLM | "
             "TTFT p50 ms kvshare | TTFT p50 ms vLLM | runs kvshare; vLLM (spread) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in records:
        flight = "all at once" if r["open_loop"] else f"{r['max_num_seqs']}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        basis = {"arrival": " (from arrival)", "scheduled": ""}.get(r["vllm_ttft_basis"] or "", "")
        lines.append(f"| {r['workload']} | {r['model']}, {r['requests']}, {flight} | {_num(r['kvshare_tok_s'])} | "
                     f"{_num(r['vllm_tok_s'])} | {ratio} | {_num(r['kvshare_ttft_p50_ms'])} | "
                     f"{_num(r['vllm_ttft_p50_ms'])}{basis} | {r['kvshare_runs']}; {r['vllm_runs']} |")
    lines += ["", "TTFT: kvshare from add_request (closed loop: when a slot frees; open loop: at submission); "
              "vLLM from the step that first schedules the request (closed loop) or from arrival (open loop). "
              "Several runs: the row is the run with the median tok/s."]
    if missing:
        lines.append(f"Incomplete: {', '.join(missing)}.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.peer.ratio_table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvshare", nargs="+", type=Path, required=True, help="offline_benchmark JSON files or folders")
    ap.add_argument("--vllm", nargs="+", type=Path, required=True, help="vllm_offline JSON files or folders")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=PATH",
                    help="kvshare rows run with other settings, shown as '<workload> (LABEL)'")
    ap.add_argument("--md", type=Path, default=None, help="also write the table here")
    ap.add_argument("--json", type=Path, default=None, help="write both sides' rows and the ratios here")
    a = ap.parse_args(argv)
    try:
        kv_files, vl_files = json_files(a.kvshare, "kvshare"), json_files(a.vllm, "vllm")
        kvshare, vllm = read_rows(kv_files), read_rows(vl_files)
    except (OSError, ValueError) as exc:
        ap.error(str(exc))
    variants: dict[str, list[Row]] = {}
    for spec in a.variant:
        label, sep, path = spec.partition("=")
        if not (sep and label and path):
            ap.error(f"--variant {spec!r}: expected LABEL=PATH")
        try:
            variants[label] = read_rows(json_files([Path(path)], "kvshare"))
        except (OSError, ValueError) as exc:
            print(f"ratio_table: variant {label!r} left out: {exc}", file=sys.stderr)
    records, missing = comparison(kvshare, vllm, variants)
    md = markdown(records, missing, vllm)
    print(md)
    if a.md:
        a.md.parent.mkdir(parents=True, exist_ok=True)
        a.md.write_text(md + "\n")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"comparison": records, "missing": missing,
                                      "kvshare_files": [str(f) for f in kv_files], "vllm_files": [str(f) for f in vl_files],
                                      "kvshare": kvshare, "vllm": vllm}, indent=1) + "\n")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
