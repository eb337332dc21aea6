"""The paged decode kernel's hot loop as Hopper machine code, compiled on a machine without a GPU.

    python -m perf.kernels.sass_loop                          # bf16 / fp8 / int8 pages, bf16 queries, GQA 32/8
    python -m perf.kernels.sass_loop --kv fp8 --q bf16 --block-n 64 --sass out.sass

Triton compiles for sm_90 with the ptxas its wheel ships (`triton.compile` with a `GPUTarget`);
triton.tools.disasm turns the cubin into SASS. The loop over K/V tiles is the instructions between
the target of the last backward branch and that branch. Per tile, each warp runs that loop once over
block_n tokens x head_dim x heads-per-program elements of K and as many of V: instructions per
element is the figure that says whether a layout can stream at memory speed (bf16 pages, which do:
~0.13 per element). What it showed (docs/decisions.md, 2026-12-06): with bf16 queries over fp8
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


def decode_cubin(q: str = "bf16", kv: str = "bf16", group: int = 4, heads: int = 1, block_n: int = 64,
                 num_warps: int = 4, num_stages: int = 3, page_size: int = 16, head_dim: int = 128,
                 arch: int = 90) -> bytes:
    """_decode_split_kernel compiled for `arch` as paged_decode_attention launches it (split-K, dots)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvshare_kernels import decode_attention as da

    fn = da._decode_split_kernel
    names = fn.arg_names
    mode = KV_MODES[kv]
    cache = {0: f"*{q}", 1: "*u8", 2: "*i8"}[mode]
    sig = {n: "i32" for n in names}
    sig.update(Q=f"*{q}", K=cache, V=cache, KS="*fp32", VS="*fp32", O=f"*{q}", PO="*fp32", PLSE="*fp32",
               PT="*i32", CTX="*i32", scale_log2="fp32", v_scale="fp32")
    const = dict(GROUP=group, HEADS=heads, BLOCK_R=max(16, triton.next_power_of_2(group * heads)),
                 BLOCK_C=heads * head_dim, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_N=block_n,
                 PAGE_SIZE=page_size, SPLIT=True, USE_DOT=True, HEAD_FASTEST=True, PRECISION="tf32",
                 UPCAST=False, KV_QUANT=mode, PAGE_IDS=False)
    sig.update({k: "constexpr" for k in const})
    aligned = [n for n in names if sig[n].startswith("*") or (n.startswith("stride_") and n != "stride_st")]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    return kernel.asm["cubin"]


def sass_of(cubin: bytes) -> str:
    from triton.tools.disasm import get_sass
    return get_sass(cubin)


def loop_mix(sass: str, elements: int) -> LoopMix:
    """The instructions between the target of the last backward conditional branch and that branch."""
    lines = sass.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.?\w+:", line)}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"@!?U?P\w+\s+BRA\s+(\S+?);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((labels[m.group(1)], i))
    if not loops:
        raise ValueError("sass_loop: no backward branch in this SASS")
    start, end = max(loops, key=lambda se: se[1] - se[0])
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
    ap.add_argument("--sass", type=Path, default=None, help="write the last SASS here")
    ap.add_argument("--json", type=Path, default=None, help="each layout's counts")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("sass_loop: compiles for the GPU; unset TRITON_INTERPRET")
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


if __name__ == "__main__":
    main()
