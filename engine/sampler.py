"""Sampler: greedy, temperature and top-p, with per-request seeds.

A seeded request draws step k's token from a generator seeded with (seed, k): the outcome
depends only on the request, never on which batch, worker or process sampled it.
"""

from __future__ import annotations

import torch

from engine.sequence import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """logits [B, V] fp32 -> one token id per row."""
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, p in enumerate(params):
        if p.temperature == 0:
            out.append(int(greedy[i]))
            continue
        probs = torch.softmax(logits[i].float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        gen = torch.Generator(device="cpu")
        seed = p.seed if p.seed is not None else torch.seed()
        gen.manual_seed((seed * 1_000_003 + steps[i]) % (1 << 63))
        out.append(int(torch.multinomial(probs.cpu(), 1, generator=gen)))
    return out
