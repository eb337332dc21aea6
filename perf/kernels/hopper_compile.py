"""Every launch kvshare's Triton kernels make, compiled for Hopper (sm_90) on a machine without a GPU.

    python -m perf.kernels.hopper_compile                 # a table: kernel, case, warps, stages, shared memory
    python -m perf.kernels.hopper_compile --json out.json

The kernel tests on the CPU run under Triton's interpreter, which never compiles: a loop-carried
value whose type changes between iterations, a layout the compiler cannot lower or a tile that
needs more shared memory than an SM has all pass there and fail on the GPU machine's first call,
where device time is scarce. This tool calls the real launchers (`kvshare_kernels.kernels` and the
fused kernels) with CPU tensors while Triton's active driver is a stand-in for one H100/H200: it
names the target (cuda, sm_90), 132 SMs and 227 KiB of shared memory per block, and turns the
launch itself into a no-op. Everything before the launch is real: the launchers' argument checks and
heuristics, Triton's specialisation on the tensors (16-byte alignment), the whole compiler and
ptxas, and the check that a kernel's shared memory fits. Run it under the GPU image's Triton (3.6)
by putting an unpacked wheel first on PYTHONPATH (perf/kernels/sass_loop.py says how).

The cases are the engine's launches on its two model shapes (Llama-3-8B's GQA 32/8 and Llama-2-7B's
MHA 32/32, head_dim 128) over every pool dtype it serves (bf16, fp16, fp8_e4m3, int8) and the page
sizes the README measures (16, 64, 128), and the Gluon prefill that copies a tile page by page
(prefill_pages_tma.py), which has no interpreter to run it on the CPU at all.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

os.environ["TRITON_INTERPRET"] = "0"     # before Triton is imported: compile, do not interpret

import torch  # noqa: E402

H100_SHARED_BYTES = 232448        # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100 and H200 (227 KiB)
H100_SMS = 132
SHAPES = {"gqa": (32, 8), "mha": (32, 32)}
HEAD_DIM = 128


@dataclass(frozen=True)
class Compiled:
    """One kernel compiled for one case: its launch configuration, shared memory, and what ptxas
    gave it (registers per thread; local memory per thread, where spills go: 0 when none; and the
    spill instructions inside its main loop, which cost on every tile, not once)."""
    case: str
    kernel: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int
    local_bytes: int
    loop_spills: int       # local loads and stores (LDL/STL) in the longest loop: spills on the hot path


class _PaperDevice:
    """The parts of `triton.runtime.driver.active` a launch reaches, for a device that is not there."""

    def __init__(self, arch: int, on_compile: Callable[[str, object, dict], None]):
        from triton.backends.compiler import GPUTarget

        self._target = GPUTarget("cuda", arch, 32)
        self._on_compile = on_compile
        self._metadata = None
        self.utils = self

    # driver
    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return self._target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def launcher_cls(self, src, metadata):
        self._metadata = metadata      # load_binary, next, has the cubin
        return lambda *args, **kwargs: None

    # driver.utils
    def get_device_properties(self, device) -> dict:
        return {"max_shared_mem": H100_SHARED_BYTES, "multiprocessor_count": H100_SMS, "max_num_regs": 65536,
                "warpSize": 32}

    def load_binary(self, name, kernel, shared, device):
        usage = _resource_usage(kernel)
        self._on_compile(name, self._metadata, usage)
        # module, function, registers, spills, max threads per block
        return 1, 1, usage["REG"], usage["LOCAL"], 1024

    def unload_module(self, module) -> None:
        pass


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """ptxas's figures for the cubin's kernel (`cuobjdump -res-usage`): REG, STACK, SHARED, LOCAL..."""
    import subprocess
    import tempfile

    from triton.tools.disasm import path_to_cuobjdump

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([path_to_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    usage = {k: int(v) for k, v in (item.split(":")[:2] for item in line.split() if item.split(":")[-1].isdigit())}
    usage["LOOP_SPILLS"] = _loop_spills(cubin) if usage["LOCAL"] or usage.get("STACK", 0) else 0
    return usage


def _loop_spills(cubin: bytes) -> int:
    """LDL/STL instructions between the target of the kernel's longest backward branch and that branch."""
    from perf.kernels.sass_loop import _loops, sass_of

    sass = sass_of(cubin)
    try:
        start, end = max(_loops(sass), key=lambda se: se[1] - se[0])
    except ValueError:         # no loop at all
        return 0
    return sum(("LDL" in ln or "STL" in ln) for ln in sass.splitlines()[start:end + 1])


def _pool(dtype: str, pages: int, page: int, hkv: int):
    """K and V pools of `dtype` and the launchers' scale arguments for them."""
    from kvshare_kernels import kv_quant

    if dtype == "int8":
        k = torch.zeros(pages, page, hkv, HEAD_DIM, dtype=torch.int8)
        scales = dict(k_scale=torch.ones(pages, page, hkv), v_scale=torch.ones(pages, page, hkv))
        return k, torch.zeros_like(k), scales
    if dtype == "fp8":
        k = torch.zeros(pages, page, hkv, HEAD_DIM, dtype=kv_quant.FP8)
        return k, torch.zeros_like(k), dict(k_scale=1.0, v_scale=1.0)
    k = torch.zeros(pages, page, hkv, HEAD_DIM, dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype]))
    return k, torch.zeros_like(k), {}


def _act_dtype(pool: str) -> torch.dtype:
    return torch.float16 if pool == "fp16" else torch.bfloat16


def _table(batch: int, pages_each: int) -> torch.Tensor:
    return torch.arange(batch * pages_each, dtype=torch.int32).view(batch, pages_each)


def _decode(pool: str, shape: str, page: int, batch: int, context: int) -> None:
    from kvshare_kernels.kernels import paged_decode_attention

    hq, hkv = SHAPES[shape]
    per = -(-context // page)
    k, v, scales = _pool(pool, batch * per, page, hkv)
    q = torch.zeros(batch, hq, HEAD_DIM, dtype=_act_dtype(pool))
    paged_decode_attention(q, k, v, _table(batch, per), torch.full((batch,), context, dtype=torch.int32), 0.088,
                           max_context=context, **scales)


def _cascade(pool: str, shape: str, page: int) -> None:
    from kvshare_kernels.cascade_decode import plan_cascade
    from kvshare_kernels.kernels import cascade_decode_attention

    hq, hkv = SHAPES[shape]
    batch, shared, own = 16, 64, 4                      # 16 rows sharing 64 pages, 4 pages each of their own
    k, v, scales = _pool(pool, shared + batch * own, page, hkv)
    table = torch.cat([torch.arange(shared, dtype=torch.int32).expand(batch, shared),
                       shared + _table(batch, own)], dim=1).contiguous()
    ctx = torch.full((batch,), (shared + own) * page - 3, dtype=torch.int32)
    plan = plan_cascade(table, ctx, page)
    q = torch.zeros(batch, hq, HEAD_DIM, dtype=_act_dtype(pool))
    cascade_decode_attention(q, k, v, table, ctx, plan, 0.088, **scales)


def _prefill(pool: str, shape: str, page: int, new_kv: bool, tiles: bool, gluon: bool = False,
             order: str = "serial") -> None:
    """paged_prefill_attention as the engine launches it; gluon: the kernel that copies a prefix tile
    page by page (prefill_pages_tma.py) on the same inputs, called directly (on CPU tensors the
    entry point's page_copies would fall back to the Triton launch)."""
    from kvshare_kernels import prefill_attention as pa
    from kvshare_kernels import prefill_pages_tma as ppt
    from kvshare_kernels.kernels import paged_prefill_attention
    from kvshare_kernels.prefill_tiles import plan_tiles, tokens_per_tile

    hq, hkv = SHAPES[shape]
    q_lens, ctx_lens = [512, 300, 1], [2560, 300, 4097]  # an extend, a prompt, a decode-like row
    t = sum(q_lens)
    per = -(-max(ctx_lens) // page)
    k, v, scales = _pool(pool, len(q_lens) * per, page, hkv)
    dtype = _act_dtype(pool)
    q = torch.zeros(t, hq, HEAD_DIM, dtype=dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(scales)
    if new_kv or gluon:
        kw.update(k_new=torch.zeros(t, hkv, HEAD_DIM, dtype=dtype), v_new=torch.zeros(t, hkv, HEAD_DIM, dtype=dtype))
    if tiles:
        block_m = ppt.BLOCK_M if gluon else pa.default_launch(page, k.dtype, HEAD_DIM, q.device, new_kv=new_kv).block_m
        kw["tiles"] = torch.from_numpy(plan_tiles(q_lens, ctx_lens, tokens_per_tile(hq, hkv, block_m), capacity=64))
    if gluon:
        kw["order"] = order
    launch = ppt.paged_prefill_pages_tma if gluon else paged_prefill_attention
    launch(q, k, v, _table(len(q_lens), per), qsl, torch.tensor(ctx_lens, dtype=torch.int32), 0.088, **kw)


def _write(pool: str, shape: str, page: int, fused_rotary: bool) -> None:
    from kvshare_kernels.fused_rotary import rotary_write_kv
    from kvshare_kernels.kernels import write_kv

    hq, hkv = SHAPES[shape]
    t = 64
    k_cache, v_cache, scales = _pool(pool, 8, page, hkv)
    dtype = _act_dtype(pool)
    k = torch.zeros(t, hkv, HEAD_DIM, dtype=dtype)
    v = torch.zeros(t, hkv, HEAD_DIM, dtype=dtype)
    slots = torch.arange(t, dtype=torch.int32)
    if fused_rotary:
        q = torch.zeros(t, hq, HEAD_DIM, dtype=dtype)
        cos = torch.zeros(4096, HEAD_DIM, dtype=dtype)
        rotary_write_kv(q, k, v, cos, cos.clone(), slots, k_cache, v_cache, slots, k_in_place=not scales, **scales)
    else:
        write_kv(k, v, k_cache, v_cache, slots, **scales)


def _elementwise() -> None:
    from kvshare_kernels.fused_norm import rms_norm
    from kvshare_kernels.fused_rotary import rotary_embedding
    from kvshare_kernels.fused_silu import silu_and_mul

    for dtype in (torch.bfloat16, torch.float16):
        x = torch.zeros(64, 4096, dtype=dtype)
        rms_norm(x, torch.ones(4096, dtype=dtype), 1e-5)
        rms_norm(x, torch.ones(4096, dtype=dtype), 1e-5, residual=torch.zeros_like(x))
        silu_and_mul(torch.zeros(64, 2 * 11008, dtype=dtype))
        q, k = torch.zeros(64, 32, HEAD_DIM, dtype=dtype), torch.zeros(64, 8, HEAD_DIM, dtype=dtype)
        cos = torch.zeros(4096, HEAD_DIM, dtype=dtype)
        rotary_embedding(q, k, cos, cos.clone(), torch.arange(64, dtype=torch.int32))


def _copies() -> None:
    from kvshare_kernels.kernels import copy_page_tensors, copy_pages

    for pool in ("bf16", "fp8", "int8"):
        k, v, scales = _pool(pool, 16, 16, 8)
        src, dst = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32)
        copy_pages(k, v, src, dst)
        if pool == "int8":
            copy_page_tensors([k, v, scales["k_scale"], scales["v_scale"]], src, dst)


def cases() -> dict[str, Callable[[], None]]:
    """Name -> a call of one launcher, in the configurations the engine launches."""
    from kvshare_kernels.prefill_pages_tma import ORDERS

    out: dict[str, Callable[[], None]] = {}
    for pool in ("bf16", "fp16", "fp8", "int8"):
        for shape in SHAPES:
            for page in (16, 64):
                # a small batch takes split-K, a large one a program per request and head group
                for batch, context in ((8, 2048), (256, 256)):
                    out[f"decode {pool} {shape} page {page} {batch}x{context}"] = (
                        lambda p=pool, s=shape, g=page, n=batch, c=context: _decode(p, s, g, n, c))
            out[f"cascade {pool} {shape} page 16"] = lambda p=pool, s=shape: _cascade(p, s, 16)
            out[f"prefill {pool} {shape} page 16"] = lambda p=pool, s=shape: _prefill(p, s, 16, False, True)
            out[f"write_kv {pool} {shape}"] = lambda p=pool, s=shape: _write(p, s, 16, False)
            out[f"rotary_write_kv {pool} {shape}"] = lambda p=pool, s=shape: _write(p, s, 16, True)
        if pool in ("bf16", "fp16"):
            for shape in SHAPES:
                # the engine's 16-bit prefill on Hopper: the chunk's keys from the step; whole-page TMA tiles
                out[f"prefill {pool} {shape} page 16, step K/V, work list"] = (
                    lambda p=pool, s=shape: _prefill(p, s, 16, True, True))
                out[f"prefill {pool} {shape} page 16, step K/V, grid"] = (
                    lambda p=pool, s=shape: _prefill(p, s, 16, True, False))
                for page in (64, 128):
                    out[f"prefill {pool} {shape} page {page} TMA, work list"] = (
                        lambda p=pool, s=shape, g=page: _prefill(p, s, g, False, True))
                out[f"prefill {pool} {shape} page 16, a copy per page (Gluon), work list"] = (
                    lambda p=pool, s=shape: _prefill(p, s, 16, True, True, gluon=True))
                out[f"prefill {pool} {shape} page 64, a copy per page (Gluon), grid"] = (
                    lambda p=pool, s=shape: _prefill(p, s, 64, True, False, gluon=True))
                for order in ORDERS[1:]:
                    out[f"prefill {pool} {shape} page 16, a copy per page (Gluon), {order}, work list"] = (
                        lambda p=pool, s=shape, o=order: _prefill(p, s, 16, True, True, gluon=True, order=o))
    out["rms_norm, silu_and_mul, rotary_embedding"] = _elementwise
    out["copy_pages, copy_page_tensors"] = _copies
    return out


def compile_all(only: str | None = None, arch: int = 90,
                calls: dict[str, Callable[[], None]] | None = None) -> tuple[list[Compiled], dict[str, str]]:
    """Runs every case of `calls` (default: cases()), or those whose name contains `only`, on the
    stand-in device; returns what compiled and, per failed case, its error. A kernel appears under
    the first case that compiled it: a later case of the same specialisation reuses it."""
    from triton.runtime import driver

    from kvshare_kernels import decode_attention

    compiled: list[Compiled] = []
    current = [""]
    device = _PaperDevice(arch, lambda name, md, usage: compiled.append(
        Compiled(current[0], name, md.num_warps, md.num_stages, md.shared, usage["REG"],
                 usage["LOCAL"] + usage.get("STACK", 0), usage["LOOP_SPILLS"])))
    driver.set_active(device)
    # split-K sizes itself by the SM count, which the launcher reads from torch only on CUDA tensors
    num_sms = decode_attention._num_sms
    decode_attention._num_sms = lambda dev: H100_SMS
    failed: dict[str, str] = {}
    try:
        for name, call in (cases() if calls is None else calls).items():
            if only and only not in name:
                continue
            current[0] = name
            try:
                call()
            except Exception as exc:     # reported per case: one failure must not hide the others
                failed[name] = f"{type(exc).__name__}: {str(exc)}"[:1500]
    finally:
        decode_attention._num_sms = num_sms
        try:
            driver.reset_active()
        except RuntimeError:     # no GPU here: no driver to go back to
            pass
    return compiled, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run the cases whose name contains this text")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90, Hopper)")
    ap.add_argument("--json", help="write the kernels compiled and the failures here")
    args = ap.parse_args(argv)
    import triton

    compiled, failed = compile_all(args.only, args.arch)
    print(f"Triton {triton.__version__}, torch {torch.__version__}, target sm_{args.arch}; shared memory limit "
          f"{H100_SHARED_BYTES} bytes")
    print(f"{'case':<64} {'kernel':<28} {'warps':>5} {'stages':>6} {'shared':>8} {'regs':>5} {'local':>6} "
          f"{'loop spills':>11}")
    for c in compiled:
        print(f"{c.case:<64} {c.kernel:<28} {c.num_warps:>5} {c.num_stages:>6} {c.shared_bytes:>8} {c.registers:>5} "
              f"{c.local_bytes:>6} {c.loop_spills:>11}")
    for name, err in failed.items():
        print(f"FAILED {name}: {err}")
    print(f"{len(compiled)} kernels compiled, {len(failed)} cases failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "arch": args.arch, "compiled": [asdict(c) for c in compiled],
                       "failed": failed}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
