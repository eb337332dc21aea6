"""The GGUF loader that keeps SmolLM2's linear layers in their blocks: the blocks widen, bit for bit,
to gguf-py's dequantization and to the fp32 weights transformers loads."""
from __future__ import annotations

import numpy as np
import pytest
import torch

# gguf-py comes with the embedded model's setup (scripts/setup.sh), not with a GPU image
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from kvshare.runtime.gguf_blocks import UnsupportedBlocks, check_against, from_raw, load_blocks
from kvshare.runtime.tokenizer import default_model_source
from kvshare.runtime.weights import load_model
from kvshare_kernels import block_linear as bl


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_from_raw_widens_as_gguf_py_does(kind):
    n, k = 48, 96
    rng = np.random.default_rng(3)
    per = {"Q4_1": 20, "Q8_0": 34}[kind]
    raw = rng.integers(0, 256, (n, k // 32, per), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, (n, k // 32, 2 if kind == "Q4_1" else 1)).astype(np.float16)
    raw[..., :2 * scales.shape[-1]] = scales.view(np.uint8).reshape(n, k // 32, -1)
    raw = raw.reshape(n, -1)
    theirs = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))
    ours = bl.dequantize(from_raw(torch.from_numpy(raw), kind, n, k))
    assert torch.equal(ours, theirs.reshape(n, k))


def test_from_raw_refuses_other_formats_by_name():
    with pytest.raises(UnsupportedBlocks, match="Q6_K"):
        from_raw(torch.zeros(16, 210, dtype=torch.uint8), "Q6_K", 16, 256)


@pytest.fixture(scope="module")
def fp32_model():
    return load_model(None)


def test_every_smollm2_block_widens_to_transformers_weights(fp32_model):
    layers, head = load_blocks(default_model_source(), fp32_model.config)
    assert len(layers) == fp32_model.config.num_layers
    for blocks, lw in zip(layers, fp32_model.weights.layers):
        for name, b in blocks.items():
            assert check_against(b, getattr(lw, name)), name
    assert head.format == "q8_0" and check_against(head, fp32_model.weights.lm_head)
    assert {b.format for lw in layers for b in lw.values()} == {"q4_1"}


@pytest.mark.parametrize("arch, message", [("qwen2", "architecture 'qwen2'"), ("llama", "no tensor blk.0.attn_q.weight")])
def test_files_the_loader_cannot_read_are_refused_with_the_reason(tmp_path, arch, message):
    from gguf import GGUFWriter

    from kvshare.runtime.model_config import NAMED_CONFIGS

    path = tmp_path / f"{arch}.gguf"
    writer = GGUFWriter(str(path), arch)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedBlocks, match=message):
        load_blocks(str(path), NAMED_CONFIGS["tiny-llama"])
