"""Next-token selection: penalties, min_tokens, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None   # per-request when seeded, so draws do not depend on the batch
    prompt_ids: tuple[int, ...] | list[int]
    output_ids: tuple[int, ...] | list[int]


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], *, seed: int = 0):
        self.eos = list(eos_token_ids)
        self.default_generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """logits fp32 [S, V] (one row per sampling request) -> one token id per row."""
        if all(r.params.greedy and not r.params.has_penalties and r.params.min_tokens == 0 for r in rows):
            return logits.argmax(dim=-1).tolist()
        logits = logits.clone()
        for i, r in enumerate(rows):
            self._adjust(logits[i], r)
        out = logits.argmax(dim=-1).tolist()
        for i, r in enumerate(rows):
            if not r.params.greedy:
                out[i] = self._draw(logits[i], r)
        return out

    def _adjust(self, row: torch.Tensor, r: SamplingRow) -> None:
        p = r.params
        if len(r.output_ids) < p.min_tokens and self.eos:
            row[self.eos] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
            ids = torch.tensor(list(r.output_ids), dtype=torch.long, device=row.device)
            counts = torch.bincount(ids, minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def _draw(self, row: torch.Tensor, r: SamplingRow) -> int:
        p = r.params
        scaled = row / p.temperature
        if 0 < p.top_k < scaled.shape[0]:
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = scaled.sort(descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (cum - sorted_logits.softmax(-1)) >= p.top_p
            scaled = scaled.index_fill(0, order[drop], float("-inf"))
        probs = scaled.softmax(-1)
        gen = r.generator or self.default_generator
        return int(torch.multinomial(probs.cpu() if gen.device.type == "cpu" else probs, 1, generator=gen))
