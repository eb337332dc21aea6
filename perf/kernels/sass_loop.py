"""The paged decode kernel's hot loop as Hopper machine code, compiled on a machine without a GPU.

    python -m perf.kernels.sass_loop                          # bf16 / fp8 / int8 pages, bf16 queries, GQA 32/8
    python -m perf.kernels.sass_loop --kv fp8 --q bf16 --block-n 64 --sass out.sass
    python -m perf.kernels.sass_loop --prefill                # prefill's page-16 prefix loop, offsets by width

Triton compiles for sm_90 with the ptxas its wheel ships (`triton.compile` with a `GPUTarget`);
triton.tools.disasm turns the cubin into SASS. The loop over K/V tiles is the instructions between
the target of the last backward branch and that branch. Per tile, each warp runs that loop once over
block_n tokens x head_dim x heads-per-program elements of K and as many of V: instructions per
element is the figure that says whether a layout can stream at memory speed (bf16 pages, which do:
~0.10-0.14 per element). What it showed (docs/decisions.md, 2026-12-06): with bf16 queries over fp8
pages each pair of e4m3 values took a native convert plus two quarter-rate scalar F2F converts.
The GPU machine runs the image's Triton (3.6), not this machine's 3.9: to count its code, unpack its
wheel (`pip download triton==3.6.0 --no-deps`, then unzip) and put that folder first on PYTHONPATH.
Pointer and stride arguments are marked 16-divisible, as the launcher's specialisation makes them
on real tensors (without that the loads are not vectorised and the counts mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

KV_MODES = {"bf16": 0, "fp8": 1, "int8": 2}


@dataclass(frozen=True)
class LoopMix:
    """The hot loop's instructions (per warp, one iteration) by opcode and by shared-memory load form."""
    instructions: int
    opcodes: Counter
    shared_loads: Counter
    elements: int          # K and V elements one warp converts and multiplies per iteration

    @property
    def per_element(self) -> float:
        return self.instructions / self.elements


def _compile(fn, sig: dict, const: dict, arch: int, num_warps: int, num_stages: int) -> bytes:
    """fn's cubin for `arch` with these argument types and constants; pointers and strides (but the
    int8 scales' token stride) marked 16-divisible, as the launcher's specialisation makes them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {**sig, **{k: "constexpr" for k in const}}
    aligned = [n for n in names if sig[n].startswith("*") or (n.startswith("stride_") and n != "stride_st")]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    return kernel.asm["cubin"]


def decode_cubin(q: str = "bf16", kv: str = "bf16", group: int = 4, heads: int = 1, block_n: int = 64,
                 num_warps: int = 4, num_stages: int = 3, page_size: int = 16, head_dim: int = 128,
                 arch: int = 90, same_rows: bool = True, rows32: bool = True) -> bytes:
    """_decode_split_kernel compiled for `arch` as paged_decode_attention launches it (split-K, dots)
    over pools of equal strides that int32 offsets address (SAME_ROWS, ROWS32)."""
    import triton

    from kvshare_kernels import decode_attention as da

    fn = da._decode_split_kernel
    names = fn.arg_names
    mode = KV_MODES[kv]
    cache = {0: f"*{q}", 1: "*u8", 2: "*i8"}[mode]
    sig = {n: "i32" for n in names}
    sig.update(Q=f"*{q}", K=cache, V=cache, KS="*fp32", VS="*fp32", O=f"*{q}", PO="*fp32", PLSE="*fp32",
               PT="*i32", CTX="*i32", scale_log2="fp32", v_scale="fp32", softcap_log2="fp32")
    const = dict(GROUP=group, HEADS=heads, BLOCK_R=max(16, triton.next_power_of_2(group * heads)),
                 BLOCK_C=heads * head_dim, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_N=block_n,
                 PAGE_SIZE=page_size, SPLIT=True, USE_DOT=True, HEAD_FASTEST=True, PRECISION="tf32",
                 UPCAST=False, KV_QUANT=mode, PAGE_IDS=False, SAME_ROWS=same_rows, ROWS32=rows32,
                 WINDOWED=False, SOFTCAP=False)
    return _compile(fn, sig, const, arch, num_warps, num_stages)


def prefill_cubin(page_size: int = 16, block_m: int = 128, block_n: int = 128, group: int = 1,
                  rows32: bool = True, same_rows: bool = True, tma: bool = False, num_warps: int = 8,
                  num_stages: int = 3, head_dim: int = 128, arch: int = 90) -> bytes:
    """_prefill_kernel compiled for `arch` over a bf16 pool, with a work list and page ids read a tile
    ahead, as the engine launches its cached prefix: rows32 and same_rows as the launcher would set
    them for small pools of equal strides (ROWS32, SAME_ROWS); tma: a tile is one page's slice."""
    import triton

    from kvshare_kernels import prefill_attention as pa

    fn = pa._prefill_kernel
    names = fn.arg_names
    sig = {n: "i32" for n in names}
    sig.update(Q="*bf16", K="*bf16", V="*bf16", KS="*fp32", VS="*fp32", O="*bf16", PT="*i32", QSL="*i32", CTX="*i32",
               TILES="*i32", scale_log2="fp32", v_scale="fp32", softcap_log2="fp32")
    block_g = triton.next_power_of_2(group)
    const = dict(GROUP=group, BLOCK_G=block_g, BLOCK_MT=block_m // block_g, BLOCK_M=block_m, BLOCK_N=block_n,
                 HEAD_DIM=head_dim, BLOCK_D=head_dim, PAGE_SIZE=page_size, PRECISION="tf32", UPCAST=False,
                 KV_QUANT=0, TILED=True, TMA=tma, PREFETCH=True, NEW_KV=False, SAME_ROWS=same_rows, ROWS32=rows32,
                 KN=None, VN=None, WINDOWED=False, SOFTCAP=False)
    if tma:
        sig.update(KD=f"tensordesc<bf16[{block_n},{head_dim}]>", VD=f"tensordesc<bf16[{block_n},{head_dim}]>")
    else:
        const.update(KD=None, VD=None)
    return _compile(fn, sig, const, arch, num_warps, num_stages)


def prefill_loop(page_size=16, rows32=True, same_rows=True, tma=False, group=1, block_n=128,
                 num_warps=8) -> LoopMix:
    """The prefix loop over whole tiles (no mask): of the kernel's loops, the shortest that issues
    tensor-core work and loads; per element of the K and V tiles one warp handles."""
    sass = sass_of(prefill_cubin(page_size, 128, block_n, group, rows32, same_rows, tma, num_warps))
    mixes = [m for m in loop_mixes(sass, 2 * block_n * 128 // num_warps) if m.opcodes.get("HGMMA")]
    return min(mixes, key=lambda m: m.instructions)


def sass_of(cubin: bytes) -> str:
    from triton.tools.disasm import get_sass
    return get_sass(cubin)


def _loops(sass: str) -> list[tuple[int, int]]:
    """(target line, branch line) of every backward conditional branch."""
    lines = sass.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.?\w+:", line)}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"@!?U?P\w+\s+BRA\s+(\S+?);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((labels[m.group(1)], i))
    if not loops:
        raise ValueError("sass_loop: no backward branch in this SASS")
    return loops


def loop_mixes(sass: str, elements: int) -> list[LoopMix]:
    """Every loop's mix (see loop_mix)."""
    lines = sass.splitlines()
    return [_mix(lines, start, end, elements) for start, end in _loops(sass)]


def loop_mix(sass: str, elements: int) -> LoopMix:
    """The instructions between the target of the last backward conditional branch and that branch."""
    start, end = max(_loops(sass), key=lambda se: se[1] - se[0])
    return _mix(sass.splitlines(), start, end, elements)


def _mix(lines: list[str], start: int, end: int, elements: int) -> LoopMix:
    ops, lds = Counter(), Counter()
    for line in lines[start + 1: end + 1]:
        if "\t" not in line:
            continue
        words = line.split("\t", 1)[1].split()
        op = words[1] if words[0].startswith("@") else words[0]
        op = op.rstrip(";")
        ops[op.split(".")[0]] += 1
        if op.startswith("LDS"):
            lds[op] += 1
    return LoopMix(sum(ops.values()), ops, lds, elements)


def decode_loop(q="bf16", kv="bf16", group=4, heads=1, block_n=64, num_warps=4, num_stages=3,
                head_dim=128) -> tuple[LoopMix, str]:
    sass = sass_of(decode_cubin(q, kv, group, heads, block_n, num_warps, num_stages, head_dim=head_dim))
    return loop_mix(sass, 2 * block_n * head_dim * heads // num_warps), sass


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--q", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--kv", default=None, choices=sorted(KV_MODES), help="default: all three")
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head (4: Llama-3-8B's 32/8)")
    ap.add_argument("--heads", type=int, default=1, help="KV heads per program")
    ap.add_argument("--block-n", type=int, default=None, help="default: the launcher's for that page layout")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=3)
    ap.add_argument("--prefill", action="store_true",
                    help="the prefill kernel's prefix loop at page 16 instead, --group query heads per KV head (row offsets int64 / int32, "
                         "V's own or K's, and a page-128 TMA tile beside them)")
    ap.add_argument("--sass", type=Path, default=None, help="write the last SASS here")
    ap.add_argument("--json", type=Path, default=None, help="each layout's counts")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("sass_loop: compiles for the GPU; unset TRITON_INTERPRET")
    if a.prefill:
        return _prefill_main(a)
    from kvshare_kernels import decode_attention as da
    records = []
    for kv in [a.kv] if a.kv else list(KV_MODES):
        block_n = a.block_n or da.default_config(a.group * 8, 8, KV_MODES[kv])["block_n"]
        mix, sass = decode_loop(a.q, kv, a.group, a.heads, block_n, a.num_warps, a.num_stages)
        top = ", ".join(f"{k} {v}" for k, v in mix.opcodes.most_common(10))
        shared = ", ".join(f"{k} {v}" for k, v in sorted(mix.shared_loads.items()))
        print(f"{kv} pages, {a.q} queries, block_n {block_n}: {mix.instructions} instructions per warp and "
              f"iteration, {mix.per_element:.3f} per K/V element; F2F {mix.opcodes['F2F']}, F2FP "
              f"{mix.opcodes['F2FP']}, HMMA {mix.opcodes['HMMA']}\n  top: {top}\n  shared loads: {shared}")
        records.append(dict(kv=kv, q=a.q, block_n=block_n, instructions=mix.instructions,
                            per_element=mix.per_element, opcodes=dict(mix.opcodes),
                            shared_loads=dict(mix.shared_loads), elements=mix.elements))
        if a.sass:
            a.sass.write_text(sass)
    if a.json:
        a.json.write_text(json.dumps(records, indent=1))


PREFILL_VARIANTS = {"int64 rows, V's own": dict(rows32=False, same_rows=False),
                    "int64 rows, K's for V": dict(rows32=False, same_rows=True),
                    "int32 rows, K's for V": dict(rows32=True, same_rows=True),
                    "page 128, TMA": dict(page_size=128, tma=True)}


def _prefill_main(a) -> None:
    records = []
    for name, kw in PREFILL_VARIANTS.items():
        mix = prefill_loop(group=a.group, **kw)
        top = ", ".join(f"{k} {v}" for k, v in mix.opcodes.most_common(10))
        print(f"prefill prefix loop, {name}: {mix.instructions} instructions per warp and 128-key tile; "
              f"LDGSTS {mix.opcodes['LDGSTS']}, IMAD {mix.opcodes['IMAD']}, LEA {mix.opcodes['LEA']}\n  top: {top}")
        records.append(dict(variant=name, instructions=mix.instructions, opcodes=dict(mix.opcodes),
                            elements=mix.elements, **kw))
    if a.json:
        a.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
