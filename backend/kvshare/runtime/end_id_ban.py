"""min_tokens on the device: the model's end ids at -inf in the rows still under their minimum.

Under overlap scheduling a greedy step's argmax never leaves the device, so the ban must not either.
The rows to ban change every step; they travel as one bool per row through two pinned host slots
taken in turn (a slot is rewritten two steps later, after the step that read it has been resolved,
as ModelRunner's id slots are) into a persistent device row mask. No tensor is allocated per step,
and nothing waits for the device. Rows whose request names its own end ids take the general path
(ModelRunner._argmax_without_ends): the mask covers the model's end ids only.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class EndIdBan:
    def __init__(self, end_ids: Sequence[int], max_rows: int, device: torch.device):
        self.end_ids = frozenset(end_ids)
        self._cols = torch.tensor(sorted(self.end_ids), dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self._host = [torch.zeros(max_rows, dtype=torch.bool, pin_memory=pin) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]      # the same memory, written without torch's dispatch
        self._slot = 0
        self._rows = torch.zeros(max_rows, dtype=torch.bool, device=device)

    def covers(self, bans: Sequence[tuple[int, tuple[int, ...] | None]]) -> bool:
        """Every banned row bans exactly the model's end ids (None: the model's)."""
        return bool(self.end_ids) and all(ends is None or frozenset(ends) == self.end_ids for _, ends in bans)

    def argmax(self, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Greedy ids of logits [n, V] with the end ids of `rows` (< n) at -inf; writes into logits."""
        n = logits.shape[0]
        host, flags = self._host[self._slot], self._host_np[self._slot]
        self._slot ^= 1
        flags[:n] = False
        flags[rows] = True
        mask = self._rows[:n]
        mask.copy_(host[:n], non_blocking=True)
        with torch.inference_mode():     # the forward's logits are inference tensors
            ends = logits.index_select(1, self._cols)
            ends.masked_fill_(mask.unsqueeze(1), float("-inf"))
            logits.index_copy_(1, self._cols, ends)
            return logits.argmax(dim=-1)
