"""A GGUF file's quantized Llama weights as kvshare_kernels BlockWeights, in kvshare's layout.

The GGUF keeps its linear layers in 32-weight blocks (SmolLM2's: Q4_1 layers, a Q8_0 embedding);
transformers widens them to fp32 when it loads the file. Kept as blocks, a CPU decode step reads
about a fifth of the bytes (kvshare_kernels/block_linear.py) for the same weight values: the
loader checks that claim on every load (``check_against``) and keeps fp32 weights where it fails.
"""
from __future__ import annotations

import numpy as np
import torch
from kvshare_kernels.block_linear import BLOCK, BlockWeight, cat_rows, dequantize, pack_q4_1, pack_q8_0, packable

from .model_config import ModelConfig

# GGUF names of one block's projections, in the order kvshare fuses them.
_QKV, _GATE_UP, _O, _DOWN = ("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), "attn_output", "ffn_down"
_BYTES = {"Q4_1": 20, "Q8_0": 34}   # bytes per block: fp16 d (and m), then the codes


class UnsupportedBlocks(ValueError):
    """The file's tensors are not (all) in a block format the CPU kernel reads."""


def _unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """The GGUF row each HF row of attn_q/attn_k comes from: llama.cpp's converter interleaves each
    head's two rotary halves; transformers undoes it when it loads the file."""
    dim = n // heads // 2
    return torch.arange(n).view(heads, dim, 2).transpose(1, 2).reshape(-1)


def _tensor(tensors: dict, name: str, rows: torch.Tensor | None = None) -> BlockWeight:
    t = tensors[name]
    k, n = (int(s) for s in t.shape)          # GGUF lists the contiguous dimension first
    try:
        # A copy: the reader's arrays map the file read-only.
        return from_raw(torch.from_numpy(np.array(t.data)), t.tensor_type.name, n, k, rows)
    except UnsupportedBlocks as exc:
        raise UnsupportedBlocks(f"{name}: {exc}") from None


def from_raw(raw: torch.Tensor, kind: str, n: int, k: int, rows: torch.Tensor | None = None) -> BlockWeight:
    """A weight [n, k] from its GGUF bytes (uint8, n rows of k/32 blocks of type ``kind``); ``rows``
    reorders the rows (HF row i is GGUF row rows[i])."""
    if kind not in _BYTES:
        raise UnsupportedBlocks(f"{kind} blocks; the CPU kernel reads {sorted(_BYTES)}")
    if not packable(n, k):
        raise UnsupportedBlocks(f"[{n}, {k}] does not fit the kernel's panels of 16 and blocks of 32")
    raw = raw.reshape(n, k // BLOCK, _BYTES[kind])
    if rows is not None:
        raw = raw.index_select(0, rows)
    d = raw[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if kind == "Q4_1":
        m = raw[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
        nibbles = raw[..., 4:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, k)   # a block's weights 0-15, then 16-31
        return pack_q4_1(q, d, m)
    q = raw[..., 2:].contiguous().view(torch.int8).reshape(n, k)
    return pack_q8_0(q, d)


def load_blocks(path: str, config: ModelConfig) -> tuple[list[dict[str, BlockWeight]], BlockWeight]:
    """Per layer {qkv, o_proj, gate_up, down} as blocks, and the lm_head (the output tensor or the tied
    embedding). Raises UnsupportedBlocks when a tensor is in another format."""
    from gguf import GGUFReader

    gguf = GGUFReader(path)
    field = gguf.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
    if arch != "llama":   # the q/k row order below is llama.cpp's converter's for Llama
        raise UnsupportedBlocks(f"architecture '{arch}': the block loader reads Llama GGUFs")
    reader = {t.name: t for t in gguf.tensors}
    missing = [f"blk.{i}.{n}.weight" for i in range(config.num_layers) for n in (*_QKV, *_GATE_UP, _O, _DOWN)
               if f"blk.{i}.{n}.weight" not in reader]
    if missing:
        raise UnsupportedBlocks(f"no tensor {missing[0]} ({len(missing)} missing)")
    q_rows = _unpermute_rows(config.num_heads * config.head_dim, config.num_heads)
    k_rows = _unpermute_rows(config.num_kv_heads * config.head_dim, config.num_kv_heads)
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        qkv = cat_rows(*(_tensor(reader, p + n + ".weight", rows) for n, rows in zip(_QKV, (q_rows, k_rows, None))))
        gate_up = cat_rows(*(_tensor(reader, p + n + ".weight") for n in _GATE_UP))
        layers.append({"qkv": qkv, "o_proj": _tensor(reader, p + _O + ".weight"), "gate_up": gate_up,
                       "down": _tensor(reader, p + _DOWN + ".weight")})
    head = "output.weight" if "output.weight" in reader else "token_embd.weight"
    return layers, _tensor(reader, head)


def check_against(blocks: BlockWeight, fp32: torch.Tensor) -> bool:
    """Whether the blocks widen to exactly the fp32 weight transformers loaded."""
    return blocks.shape == tuple(fp32.shape) and torch.equal(dequantize(blocks), fp32)
