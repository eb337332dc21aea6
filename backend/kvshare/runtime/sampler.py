"""Next-token selection: penalties, min_tokens, temperature, top-k, top-p, per-request seeds.

Greedy rows cost one argmax and one small device->host copy (the step's only synchronisation);
when the CUDA graph already computed the argmax, only the copy. Unseeded random rows are drawn
together on the logits' device (sample_grouped), by the cheapest path that keeps their
distribution: pure temperature rows race on the raw logits (no sort, no softmax), top-k rows inside
a torch.topk window, and only top-p-without-top-k rows sort the whole vocabulary (sample_batched);
on CUDA small batches of top-k or mixed rows take the one sort, which launches fewer kernels.
Rows with a per-request seed keep a per-row draw from their own CPU generator, so a seeded
request's tokens do not depend on its batch; penalties and min_tokens are applied per row as well
(the slower path).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams

# Rows with a larger top_k sort the vocabulary instead: a wide topk costs about as much as a sort,
# and every row of the top-k group pays for the group's widest window.
TOP_K_WINDOW_MAX = 1024
# On CUDA the grouped paths launch more kernels than one sort, which wins at small sizes (H200,
# perf/results/kernels/2026-11-30/sampler.log, rows x vocab): a batch of top-k rows only is faster in the
# window from ~8M logits (64 x 128k: 1.9x; 12 x 32k: 0.7x), a batch mixing paths from ~32M (256 x 128k:
# 1.7x; 256 x 32k: 0.6x). Pure temperature rows race on the raw logits at any size (4.7-8.9x); on the
# CPU every grouped path wins (12-26x).
CUDA_WINDOW_MIN_LOGITS = 8_000_000
CUDA_MIXED_MIN_LOGITS = 32_000_000


def use_one_sort(device_type: str, num_temperature: int, num_window: int, num_sort: int, vocab: int) -> bool:
    """Whether to draw every random row by the full sort (sample_batched) instead of by path."""
    if device_type != "cuda":
        return False
    paths = (num_temperature > 0) + (num_window > 0) + (num_sort > 0)
    logits = (num_temperature + num_window + num_sort) * vocab
    if paths > 1:
        return logits < CUDA_MIXED_MIN_LOGITS
    return num_window > 0 and logits < CUDA_WINDOW_MIN_LOGITS


@dataclass(frozen=True)
class TokenDetail:
    """A sampled token's log-probability, the top candidates' (id, log-probability), its raw logits."""
    logprob: float
    top: tuple[tuple[int, float], ...]
    logits: torch.Tensor | None          # fp32 [V] on the host, when the request returns generation logits


def banned_next_tokens(words: tuple[tuple[int, ...], ...], prompt_ids, output_ids) -> list[int]:
    """Last tokens of the bad words whose other tokens end the sequence so far (prompt + output)."""
    banned = []
    for word in words:
        head = word[:-1]
        if not head:
            banned.append(word[-1])
            continue
        n = len(head)
        tail = list(output_ids[-n:]) if len(output_ids) >= n else list(prompt_ids[len(prompt_ids) - (n - len(output_ids)):]) + list(output_ids)
        if tuple(tail) == head:
            banned.append(word[-1])
    return banned


def _adjusts_now(r: "SamplingRow") -> bool:
    p = r.params
    return (p.has_penalties or bool(p.bad_words) or bool(p.logit_bias)
            or (p.min_tokens > 0 and len(r.output_ids) < p.min_tokens))


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None   # per-request when seeded, so draws do not depend on the batch
    prompt_ids: tuple[int, ...] | list[int]
    output_ids: tuple[int, ...] | list[int]


def _exponential(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) noise for the exponential race, never 0: a filtered token's 0 / 0 or -inf - log 0 is NaN,
    which argmax would pick."""
    noise = torch.empty(shape, device=device)
    if noise.device.type == "cpu":
        # CPU exponential_ draws serially in double (~15 ns an element, 30 ms for 64 x 32000);
        # -log(U) with U in [0, 1) vectorises and has CUDA's 24-bit resolution (U = 0 gives +inf: never wins).
        return noise.uniform_(generator=generator).log_().neg_()
    return noise.exponential_(generator=generator)      # CUDA's excludes 0


def sample_batched(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                   top_p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of logits [S, V] (fp32): temperature [S] > 0, top_k [S] (0 = off) or None, top_p [S].

    The same filters as the per-row path: keep the top_k largest (ties at the k-th kept), then the
    smallest prefix of the sorted distribution whose mass reaches top_p (the first token always
    stays); draw by the exponential-race trick (argmax of p / E, E ~ Exp(1)). Sorts the whole
    vocabulary: sample_grouped sends here only the rows that need it.
    """
    vocab = logits.shape[-1]
    scaled = logits / temperature[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    if top_k is not None:
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab)).long()
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    probs = probs.masked_fill(drop, 0.0)
    race = _exponential(tuple(probs.shape), probs.device, generator)
    pick = (probs / race).argmax(dim=-1, keepdim=True)
    return order.gather(1, pick).squeeze(1)


def sample_temperature(logits: torch.Tensor, temperature: torch.Tensor,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Draws from softmax(logits / T) per row without a sort or a softmax (Gumbel-max).

    argmax(p / E) = argmax(logits / T - log E) = argmax(logits - T log E) for T > 0: the same race
    as sample_batched, two passes fewer, and logits is never written.
    """
    log_e = _exponential(tuple(logits.shape), logits.device, generator).log_()
    return torch.addcmul(logits, temperature[:, None], log_e, value=-1.0).argmax(dim=-1)


@dataclass
class TopKWindow:
    """The filtered distribution of top-k rows, kept inside a topk window of k_max candidates.

    probs [n, k_max]: the kept window tokens' probabilities (0 for dropped ones), ids [n, k_max] their
    vocab ids. Tokens outside the window whose logit equals the k-th (ties kept, as in the sort path)
    are counted, not listed: ties_cum [n, V] is the running count of them in vocab order (its last
    column is their number m), tie_mass [n] the mass top-p leaves them, shared equally.
    """
    probs: torch.Tensor
    ids: torch.Tensor
    ties_cum: torch.Tensor
    tie_mass: torch.Tensor


def top_k_window(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None,
                 k_max: int) -> TopKWindow:
    """top_k [n] in 1..k_max (long), top_p [n] with +inf for off, or None when no row has it."""
    # Division by T > 0 keeps the order, so the window and the ties are found on the raw logits and
    # only the k_max candidates are scaled. (Rounding can merge two fp32 logits one ulp apart into a
    # tie after the division, which the sort path would keep; half-precision lm_head logits are never
    # that close.)
    vals, ids = logits.topk(k_max, dim=-1)
    kth = vals.gather(1, (top_k - 1)[:, None])
    # A tie at the k-th value can reach past the window; the sort path keeps all of them, so they are
    # counted over the whole vocabulary (a compare and a scan, still no sort).
    ties = logits == kth
    ties.scatter_(1, ids, False)
    ties_cum = ties.cumsum(-1, dtype=torch.int32)
    outside = ties_cum[:, -1:].float()
    scaled = (vals / temperature[:, None]).masked_fill(vals < kth, float("-inf"))
    weights = (scaled - scaled[:, :1]).exp()
    tie_weight = weights.gather(1, (top_k - 1)[:, None])
    total = weights.sum(-1, keepdim=True) + outside * tie_weight
    probs, tie_prob = weights / total, tie_weight / total
    if top_p is None:
        tie_mass = outside * tie_prob
    else:
        cum = probs.cumsum(-1)
        probs = probs.masked_fill(cum - probs >= top_p[:, None], 0.0)
        # The outside ties come after the whole window in the sorted order, each with tie_prob: the
        # j-th (from 0) stays while the mass before it, cum[-1] + j * tie_prob, is below top_p.
        # With tie_prob = 0 this is NaN or inf; the mass is then 0 or NaN, and a NaN score never wins.
        kept = ((top_p[:, None] - cum[:, -1:]) / tie_prob).ceil().clamp_min(0.0)
        tie_mass = torch.minimum(kept, outside) * tie_prob
    return TopKWindow(probs, ids, ties_cum, tie_mass.squeeze(1))


def sample_top_k(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None,
                 k_max: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The sort path's top-k (+ top-p) draw from a topk window (top_k_window); one race for the window,
    one for the outside ties as a group (the best of n Exp(1) is Exp(1) / n), then a uniform pick
    among those ties when the group wins."""
    w = top_k_window(logits, temperature, top_k, top_p, k_max)
    n = logits.shape[0]
    noise = _exponential((n, k_max + 2), logits.device, generator)
    best, arg = (w.probs / noise[:, :k_max]).max(dim=-1)
    group_wins = w.tie_mass / noise[:, k_max] > best
    # A uniform pick among the m outside ties: the (j+1)-th, j = floor(U m), found in their running count.
    outside = w.ties_cum[:, -1]
    uniform = noise[:, k_max + 1].neg().exp()
    j = torch.minimum((uniform * outside).floor(), outside - 1.0)
    tie_id = torch.searchsorted(w.ties_cum, (j + 1.0).to(torch.int32)[:, None]).squeeze(1)
    return torch.where(group_wins, tie_id, w.ids.gather(1, arg[:, None]).squeeze(1))


def sample_grouped(logits: torch.Tensor, params: Sequence[SamplingParams | None],
                   generator: torch.Generator | None = None, base: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits [S, V]: rows whose params are None or greedy keep base (their
    argmax when base is None); the others are drawn by path (pure temperature, top-k window, sort).

    The grouping reads params on the host; the device sees two small copies and no synchronisation.
    """
    vocab = logits.shape[-1]
    temp_rows: list[int] = []
    window_rows: list[int] = []
    sort_rows: list[int] = []
    for i, p in enumerate(params):
        if p is None or p.temperature == 0.0:
            continue
        k = p.top_k if 0 < p.top_k < vocab else 0
        if 0 < k <= TOP_K_WINDOW_MAX:
            window_rows.append(i)
        elif k or p.top_p < 1.0:
            sort_rows.append(i)
        else:
            temp_rows.append(i)
    if use_one_sort(logits.device.type, len(temp_rows), len(window_rows), len(sort_rows), vocab):
        temp_rows, window_rows, sort_rows = [], [], sorted(temp_rows + window_rows + sort_rows)
    picked = temp_rows + window_rows + sort_rows
    if not picked:
        return base if base is not None else logits.argmax(dim=-1)
    window_k = [params[i].top_k for i in window_rows]
    sort_k = [params[i].top_k if 0 < params[i].top_k < vocab else 0 for i in sort_rows]
    window_p = [params[i].top_p if params[i].top_p < 1.0 else math.inf for i in window_rows]
    sort_p = [params[i].top_p for i in sort_rows]
    ints = torch.tensor(picked + window_k + sort_k, dtype=torch.long).to(logits.device, non_blocking=True)
    floats = torch.tensor([params[i].temperature for i in picked] + window_p + sort_p,
                          dtype=torch.float32).to(logits.device, non_blocking=True)
    n_t, n_w, n_s, n = len(temp_rows), len(window_rows), len(sort_rows), len(picked)
    whole = n == logits.shape[0]           # every row drawn in path order: no gathers when one path has them all

    def rows_of(start: int, count: int) -> torch.Tensor:
        if whole and count == n:
            return logits
        return logits.index_select(0, ints[start:start + count])

    drawn = []
    if n_t:
        drawn.append(sample_temperature(rows_of(0, n_t), floats[:n_t], generator))
    if n_w:
        top_p = floats[n:n + n_w] if any(p < 1.0 for p in window_p) else None
        drawn.append(sample_top_k(rows_of(n_t, n_w), floats[n_t:n_t + n_w], ints[n:n + n_w], top_p,
                                  max(window_k), generator))
    if n_s:
        top_k = ints[n + n_w:n + n_w + n_s] if any(sort_k) else None
        drawn.append(sample_batched(rows_of(n_t + n_w, n_s), floats[n_t + n_w:n], top_k,
                                    floats[n + n_w:n + n_w + n_s], generator))
    tokens = drawn[0] if len(drawn) == 1 else torch.cat(drawn)
    if whole:
        return tokens if len(drawn) == 1 else torch.empty_like(tokens).index_copy_(0, ints[:n], tokens)
    if base is None:
        base = logits.argmax(dim=-1)
    return base.index_copy(0, ints[:n], tokens)


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
        logits is never written: details() reads the raw rows afterwards.
        """
        adjust = [i for i, r in enumerate(rows) if _adjusts_now(r)]
        if not adjust and all(r.params.greedy for r in rows):
            return (greedy_ids if greedy_ids is not None else logits.argmax(dim=-1)).tolist()
        if adjust:
            logits = logits.clone()
            for i in adjust:
                self._adjust(logits[i], rows[i])
        out = greedy_ids if greedy_ids is not None and not adjust else None
        batched = [r.params if not r.params.greedy and r.generator is None else None for r in rows]
        out = sample_grouped(logits, batched, self._generator(logits.device), base=out)
        tokens = out.tolist()
        for i, r in enumerate(rows):
            if not r.params.greedy and r.generator is not None:
                tokens[i] = self._draw(logits[i], r)
        return tokens

    @torch.inference_mode()
    def details(self, logits: torch.Tensor, rows: list[SamplingRow], tokens: list[int]) -> list[TokenDetail | None]:
        """What rows asked for beside their token: log-probabilities (log_softmax of the raw logits,
        before penalties and temperature, as vLLM and TensorRT-LLM report them) and raw logits.
        One device->host copy for all rows that ask; None for the rest."""
        wanted = [i for i, r in enumerate(rows) if r.params.needs_logits_on_host]
        if not wanted:
            return [None] * len(rows)
        raw = logits.index_select(0, torch.tensor(wanted, device=logits.device)) if len(wanted) < len(rows) else logits
        logp = torch.log_softmax(raw.float(), dim=-1)
        k = max(rows[i].params.logprobs for i in wanted)
        top_vals = top_ids = None
        if k > 0:
            top_vals, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
            top_vals, top_ids = top_vals.cpu().tolist(), top_ids.cpu().tolist()
        picked = logp.gather(1, torch.tensor([tokens[i] for i in wanted], device=logp.device)[:, None])
        picked = picked.squeeze(1).cpu().tolist()
        host_raw = raw.cpu() if any(rows[i].params.return_generation_logits for i in wanted) else None
        out: list[TokenDetail | None] = [None] * len(rows)
        for j, i in enumerate(wanted):
            p = rows[i].params
            top = ()
            if p.logprobs > 0 and top_ids is not None:
                top = tuple(zip(top_ids[j][:p.logprobs], top_vals[j][:p.logprobs]))
            out[i] = TokenDetail(picked[j], top, host_raw[j].clone() if p.return_generation_logits else None)
        return out

    def _adjust(self, row: torch.Tensor, r: SamplingRow) -> None:
        p = r.params
        if len(r.output_ids) < p.min_tokens:
            ends = list(p.end_ids) if p.end_ids is not None else self.eos
            if ends:
                row[ends] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
            ids = torch.tensor(list(r.output_ids), dtype=torch.long, device=row.device)
            counts = torch.bincount(ids, minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=row.device)
            row.index_add_(0, ids, torch.tensor([w for _, w in p.logit_bias], dtype=row.dtype, device=row.device))
        if p.bad_words:
            banned = banned_next_tokens(p.bad_words, r.prompt_ids, r.output_ids)
            if banned:
                row[banned] = float("-inf")

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
