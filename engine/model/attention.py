"""Attention over the paged KV pool.

`AttentionMetadata` describes one forward step: a flat batch of T new tokens belonging to B
sequences, each sequence contributing `query_lens[i]` new tokens after `context_lens[i] -
query_lens[i]` tokens already cached. Whole prefill, chunked prefill, decode and mixes of them
are all the same call: decode is simply query_len == 1.

`AttentionBackend` is the seam for faster kernels: `TorchReferenceAttention` is the readable
reference and the tests' oracle (one loop over the sequences); `engine/model/cpu_attention.py` is the
batched CPU hot path and `engine/gpu/` the GPU one, both with identical semantics.
`engine/model/attention_registry.py` picks one for a device (so this base never imports a backend).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.kv.cache import KVCache


@dataclass
class AttentionMetadata:
    """One step's attention inputs. Built once per step (never per layer): derived figures are
    computed here at construction, and a backend adds its own per-step state in `prepare`."""

    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    query_lens: list[int]  # [B] new tokens per sequence (sum = T)
    context_lens: list[int]  # [B] tokens visible after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with any valid block id
    context_lens_t: torch.Tensor  # [B] int32, same as context_lens, on device (for kernels)
    is_decode_only: bool = field(init=False)  # every sequence has exactly one new token
    backend_state: Any = None  # what the backend's `prepare` computed for this step

    def __post_init__(self) -> None:
        self.is_decode_only = all(q == 1 for q in self.query_lens)


class AttentionBackend(ABC):
    """Writes the step's K/V into the pool, then attends each query to its sequence's context.

    Invariant: query j of sequence i (absolute position context_lens[i] - query_lens[i] + j)
    attends to exactly the keys at positions <= its own, read back from the pool, so cached and
    freshly computed keys are treated identically (the equality oracle across chunking depends
    on it)."""

    def prepare(self, meta: AttentionMetadata, cache: KVCache) -> None:
        """Once per step, before the first layer: per-step work the layers share (masks, gather
        indices) goes into `meta.backend_state`. Default: nothing."""
        return None

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]."""


def attend_one(
    layer: int,
    qi: torch.Tensor,
    cache: KVCache,
    block_table: torch.Tensor,
    ctx: int,
    scale: float,
) -> torch.Tensor:
    """One sequence: qi [qlen, Hq, D], the last qlen of its ctx positions -> out [qlen, Hq, D],
    attending to its pages (dequantized) with a causal mask offset by the cached prefix."""
    qlen, Hq = qi.shape[0], qi.shape[1]
    kc, vc = cache.gather(layer, block_table, ctx, out_dtype=qi.dtype)  # [ctx, Hkv, D]
    group = Hq // kc.shape[1]
    kc = kc.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, ctx, D]
    vc = vc.transpose(0, 1).repeat_interleave(group, dim=0)
    # causal with an offset: query j sits at position ctx - qlen + j
    q_pos = torch.arange(ctx - qlen, ctx, device=qi.device)[:, None]
    mask = torch.arange(ctx, device=qi.device)[None, :] <= q_pos  # [qlen, ctx]
    oi = F.scaled_dot_product_attention(qi.transpose(0, 1), kc, vc, attn_mask=mask, scale=scale)
    return oi.transpose(0, 1)


class TorchReferenceAttention(AttentionBackend):
    """The oracle: one sequence at a time, every page gathered and dequantized."""

    def forward(self, layer, q, k, v, cache, meta, scale):
        cache.write(layer, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        start = 0
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            out[start : start + qlen] = attend_one(
                layer, q[start : start + qlen], cache, meta.block_tables[i], ctx, scale
            )
            start += qlen
        return out
