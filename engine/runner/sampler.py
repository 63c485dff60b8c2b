"""Sampler: greedy, temperature, top-k and top-p, as batched tensor ops on the logits' device.

Only the B chosen ids cross to the host (`.tolist()` of one [B] tensor); the [B, vocab] logits
never do. Rows are drawn with the exponential race (Gumbel-max in another form): for
probabilities p and independent E_i ~ Exp(1), argmax_i p_i / E_i is distributed as p. That turns
sampling into one elementwise divide and one argmax over the whole batch; the only per-row work
is drawing the noise of *seeded* rows.

Seeds: a seeded request draws step k's noise from a generator seeded with (seed, k), so its
tokens depend only on the request, never on which batch, worker or process sampled it. Unseeded
rows share one draw from the device generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import SamplingParams


def step_seed(seed: int, step: int) -> int:
    """A seeded row's generator seed at its `step`-th sampled token: the request's seed and the step
    alone, so the row draws the same whichever batch it runs in (the persistent batch uses it too)."""
    return (seed * 1_000_003 + step) % (1 << 63)


@dataclass
class SamplingRows:
    """The sampling parameters of a step's rows, as tensors on the logits' device.

    Built per step from `SamplingParams` (or kept per row by the persistent batch). `greedy` says
    every row is greedy (then nothing else is read)."""

    temperature: torch.Tensor  # [B] fp32 (0 = greedy)
    top_p: torch.Tensor  # [B] fp32 in (0, 1]
    top_k: torch.Tensor  # [B] long (0 = off)
    seeded: list[tuple[int, int]]  # (row, generator seed for this step) of the seeded random rows
    greedy: bool  # every row is greedy
    filtered: bool  # some random row has top_p < 1 or top_k > 0

    @classmethod
    def build(cls, params: list[SamplingParams], steps: list[int], device: torch.device) -> SamplingRows:
        """From per-row params and sampling step indexes (one small tensor of each per step)."""
        temps = [p.temperature for p in params]
        greedy = not any(temps)
        seeded = [
            (i, step_seed(p.seed, steps[i])) for i, p in enumerate(params) if p.temperature > 0 and p.seed is not None
        ]
        filtered = any(p.temperature > 0 and (p.top_p < 1.0 or p.top_k > 0) for p in params)
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            seeded=seeded,
            greedy=greedy,
            filtered=filtered,
        )

    def cat(self, other: SamplingRows) -> SamplingRows:
        """These rows, then `other`'s (a mixed step: the batch's rows, then finished prefills)."""
        n = self.temperature.shape[0]
        return SamplingRows(
            temperature=torch.cat([self.temperature, other.temperature]),
            top_p=torch.cat([self.top_p, other.top_p]),
            top_k=torch.cat([self.top_k, other.top_k]),
            seeded=self.seeded + [(n + i, seed) for i, seed in other.seeded],
            greedy=self.greedy and other.greedy,
            filtered=self.filtered or other.filtered,
        )


class Sampler:
    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)  # unseeded rows
        self.generator.seed()

    def __call__(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """logits [B, V] fp32 -> token ids [B] long, on the logits' device."""
        greedy_ids = logits.argmax(dim=-1)
        if rows.greedy:
            return greedy_ids
        temp = rows.temperature.clamp(min=1e-6)[:, None]  # greedy rows are replaced below
        probs = (logits / temp).softmax(dim=-1)  # [B, V], in vocabulary order
        if rows.filtered:
            # top-k / top-p decided in sorted order (one sort per step), applied in vocabulary
            # order, so every row's noise lines up with the same tokens in any batch
            sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
            rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
            k = torch.where(rows.top_k > 0, rows.top_k, probs.shape[-1])[:, None]
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # always keeps the top token
            keep_sorted = (rank < k) & (mass_before < rows.top_p[:, None])
            keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
            probs = probs.masked_fill_(~keep, 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        if rows.seeded:  # a seeded row's noise depends only on (seed, step): its own generator
            gen = torch.Generator(device=logits.device)
            for i, seed in rows.seeded:
                gen.manual_seed(seed)
                noise[i].exponential_(generator=gen)
        choice = (probs / noise).argmax(dim=-1)
        return torch.where(rows.temperature > 0, choice, greedy_ids)


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """logits [B, V] fp32 -> one token id per row (a one-off Sampler; engines keep theirs)."""
    rows = SamplingRows.build(params, steps, logits.device)
    return Sampler(logits.device)(logits, rows).tolist()
