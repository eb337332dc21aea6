"""The model dtypes an EngineConfig may name, as torch dtypes.

Their own module because the engine (rank 0) and the tensor-parallel follower ranks both turn
`EngineConfig.dtype` into a torch dtype, and the engine imports the ranks' module: the table
cannot live in either without an import circle.
"""
from __future__ import annotations

import torch

MODEL_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                        "bfloat16": torch.bfloat16}
