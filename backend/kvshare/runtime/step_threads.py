"""Torch threads per CPU step: prompt steps on every core, decode steps on fewer.

Inside the server a CPU engine shares its cores with the stub's response pump, its IPC and
tritonserver's gRPC threads. A decode step is hundreds of small parallel regions (~0.1 ms each on
SmolLM2-135M), and an OpenMP region waits for its slowest thread: one preempted thread stalls the
step, so on machines of more than two cores decode steps leave a core to the server
(triton_adapter/cpu_threads.py; on two, idling half the machine cost more than the stalls). A prompt's
prefill is few, large regions (a 1,536-row gate_up takes 25 ms on one core, 13 ms on two), where a
short preemption costs little and a second core halves the step. So a step that carries a prompt
chunk runs on ``prefill`` threads and a decode-only step on ``decode`` threads.

The split is by the step's kind, not its size, for the bits: the prefill path (SDPA over whole
chunks, the block and oneDNN linear layers, the norms) gives the same bits at any thread count
(tests/backend/runtime/test_step_threads.py), and so does the native decode attention
(kvshare_kernels/cpu/paged_decode.cpp), but its torch fallback (flash SDPA over one query per
head group, for 8-bit pages or a CPU without AVX-512) does not. Decode steps thus always run at
one count, and a prompt's rows get the same bits whatever the thread counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepThreads:
    decode: int
    prefill: int

    def __post_init__(self):
        for name in ("decode", "prefill"):
            if getattr(self, name) < 1:
                raise ValueError(f"StepThreads.{name} must be >= 1, got {getattr(self, name)}")

    def for_step(self, prompt: bool) -> int:
        return self.prefill if prompt else self.decode

    def apply(self, prompt: bool) -> None:
        """Sets torch's thread count for the next step (~2 µs when it changes, nothing when not)."""
        n = self.for_step(prompt)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
