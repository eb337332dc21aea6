"""Next-token selection: penalties, min_tokens, temperature, top-k, top-p, per-request seeds.

Greedy rows cost one argmax and one small device->host copy (the step's only synchronisation);
when the CUDA graph already computed the argmax, only the copy. Unseeded random rows are drawn
together on the logits' device (sample_batched). Rows with a per-request seed keep a per-row draw
from their own CPU generator, so a seeded request's tokens do not depend on its batch; penalties
and min_tokens are applied per row as well (the slower path).
"""
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


def sample_batched(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of logits [S, V] (fp32): temperature [S] > 0, top_k [S] (0 = off), top_p [S].

    The same filters as the per-row path: keep the top_k largest (ties at the k-th kept), then the
    smallest prefix of the sorted distribution whose mass reaches top_p (the first token always
    stays); draw by the exponential-race trick (argmax of p / E, E ~ Exp(1)).
    """
    vocab = logits.shape[-1]
    scaled = logits / temperature[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab)).long()
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    probs = probs.masked_fill(drop, 0.0)
    race = torch.empty_like(probs).exponential_(generator=generator)
    pick = (probs / race).argmax(dim=-1, keepdim=True)
    return order.gather(1, pick).squeeze(1)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], *, seed: int = 0):
        self.eos = list(eos_token_ids)
        self.seed = seed
        self.default_generator = torch.Generator().manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.default_generator
        gen = self._device_generators.get(device)
        if gen is None:
            gen = self._device_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 greedy_ids: torch.Tensor | None = None) -> list[int]:
        """logits fp32 [S, V] (one row per sampling request) -> one token id per row.

        greedy_ids: logits.argmax(-1) when the caller already has it on the device (a CUDA graph).
        """
        if all(r.params.greedy and not r.params.has_penalties and r.params.min_tokens == 0 for r in rows):
            return (greedy_ids if greedy_ids is not None else logits.argmax(dim=-1)).tolist()
        adjust = [i for i, r in enumerate(rows)
                  if r.params.has_penalties or (r.params.min_tokens and len(r.output_ids) < r.params.min_tokens)]
        if adjust:
            logits = logits.clone()
            for i in adjust:
                self._adjust(logits[i], rows[i])
        out = logits.argmax(dim=-1)
        batched = [i for i, r in enumerate(rows) if not r.params.greedy and r.generator is None]
        if batched:
            idx = torch.tensor(batched, dtype=torch.long).to(logits.device, non_blocking=True)
            f32 = dict(dtype=torch.float32)
            temp = torch.tensor([rows[i].params.temperature for i in batched], **f32).to(logits.device)
            top_p = torch.tensor([rows[i].params.top_p for i in batched], **f32).to(logits.device)
            top_k = torch.tensor([rows[i].params.top_k for i in batched], dtype=torch.long).to(logits.device)
            drawn = sample_batched(logits.index_select(0, idx), temp, top_k, top_p, self._generator(logits.device))
            out = out.index_copy(0, idx, drawn)
        tokens = out.tolist()
        for i, r in enumerate(rows):
            if not r.params.greedy and r.generator is not None:
                tokens[i] = self._draw(logits[i], r)
        return tokens

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
        """Seeded rows: one draw from the request's own CPU generator (reproducible across batches)."""
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
