"""Attention over the paged KV pool.

`AttentionMetadata` describes one forward step: a flat batch of T new tokens belonging to B
sequences, each sequence contributing `query_lens[i]` new tokens after `context_lens[i] -
query_lens[i]` tokens already cached. Whole prefill, chunked prefill, decode and mixes of them
are all the same call: decode is simply query_len == 1.

`AttentionBackend` is the seam for GPU kernels: `TorchReferenceAttention` is the readable,
CPU-capable reference; `engine/gpu/` provides faster backends with identical semantics, and
`engine/attention_registry.py` picks one for a device (so this base never imports a backend).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    query_lens: list[int]  # [B] new tokens per sequence (sum = T)
    context_lens: list[int]  # [B] tokens visible after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    context_lens_t: torch.Tensor  # [B] int32, same as context_lens, on device (for kernels)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)


class AttentionBackend(ABC):
    """Writes the step's K/V into the pool, then attends each query to its sequence's context.

    Invariant: query j of sequence i (absolute position context_lens[i] - query_lens[i] + j)
    attends to exactly the keys at positions <= its own, read back from the pool, so cached and
    freshly computed keys are treated identically (the equality oracle across chunking depends
    on it)."""

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


class TorchReferenceAttention(AttentionBackend):
    def forward(self, layer, q, k, v, cache, meta, scale):
        cache.write(layer, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        start = 0
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            kc, vc = cache.gather(layer, meta.block_tables[i], ctx, out_dtype=q.dtype)  # [ctx, Hkv, D]
            qi = q[start : start + qlen].transpose(0, 1)  # [Hq, qlen, D]
            kc = kc.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, ctx, D]
            vc = vc.transpose(0, 1).repeat_interleave(group, dim=0)
            # causal with an offset: query j sits at position ctx - qlen + j
            q_pos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos  # [qlen, ctx]
            oi = F.scaled_dot_product_attention(qi, kc, vc, attn_mask=mask, scale=scale)
            out[start : start + qlen] = oi.transpose(0, 1)
            start += qlen
        return out
