"""CudaAttention: the GPU attention backend (same contract as TorchReferenceAttention).

Per step and layer:
1. The step's K/V go into the pool with `KVCache.write` (vectorized: one quantize and one
   scatter per K and V; the same code as the reference, so the cached bytes are identical).
2. Sequences with one new token (decode) run through the Triton paged kernel, all in one launch.
3. Prefill sequences with no cached prefix run through SDPA with `is_causal` (the flash
   backend on bf16). Their K/V are "fake-quantized" (quantize then dequantize, exactly what
   reading the page back yields), so the result equals attending to the pool, without a gather.
4. Chunked-prefill sequences (a cached prefix) gather their pages and run SDPA with the
   bottom-right causal mask (the memory-efficient backend; flash cannot take an offset mask).

Semantics match the reference: every query sees exactly the keys at positions <= its own, with
the values the pool holds. Differences are only in float rounding order (online softmax in the
kernel, bf16 probabilities in the P.V product), covered by the tolerances in the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.gpu.paged_decode import paged_decode
from engine.kv.cache import KVCache, quantize_fp8
from engine.model.attention import AttentionBackend, AttentionMetadata


def as_read_back(cache: KVCache, x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> the values the pool returns for x after `cache.write` (same ops as
    `KVCache.gather`, so the result is bit-identical to writing and gathering)."""
    if cache.is_fp8:
        q, s = quantize_fp8(x)
        return q.to(x.dtype) * s.unsqueeze(-1).to(x.dtype)
    return x.to(cache.data.dtype).to(x.dtype)


class CudaAttention(AttentionBackend):
    def __init__(self, decode_splits: int | None = None):
        self.decode_splits = decode_splits  # None: chosen from batch and capacity (paged_decode)

    def forward(self, layer, q, k, v, cache, meta: AttentionMetadata, scale):
        cache.write(layer, meta.slot_mapping, k, v)
        if meta.is_decode_only:  # the hot path, and the only one inside CUDA graphs
            return paged_decode(
                q, cache, layer, meta.block_tables, meta.context_lens_t, scale, num_splits=self.decode_splits
            )
        out = torch.empty_like(q)
        starts, decode_rows, decode_seqs = [], [], []
        pos = 0
        for i, qlen in enumerate(meta.query_lens):
            starts.append(pos)
            if qlen == 1:
                decode_rows.append(pos)
                decode_seqs.append(i)
            pos += qlen
        if decode_rows:  # mixed batch (colocated chunked prefill): decode rows in one launch
            rows = torch.tensor(decode_rows, device=q.device)
            seqs = torch.tensor(decode_seqs, device=q.device)
            out[rows] = paged_decode(
                q[rows],
                cache,
                layer,
                meta.block_tables[seqs],
                meta.context_lens_t[seqs],
                scale,
                num_splits=self.decode_splits,
            )
        group = q.shape[1] // k.shape[1]
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            if qlen == 1:
                continue
            s = starts[i]
            qi = q[s : s + qlen].transpose(0, 1)  # [Hq, qlen, D]
            if ctx == qlen:  # nothing cached before: plain causal attention over this step's K/V
                ki, vi = as_read_back(cache, k[s : s + qlen]), as_read_back(cache, v[s : s + qlen])
                mask, causal = None, True
            else:  # chunked prefill: cached prefix + this chunk, read back from the pages
                ki, vi = cache.gather(layer, meta.block_tables[i], ctx, out_dtype=q.dtype)
                q_pos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
                mask, causal = torch.arange(ctx, device=q.device)[None, :] <= q_pos, False  # [qlen, ctx]
            # [ctx, Hkv, D] -> [Hq, ctx, D]; explicit repeat keeps SDPA on the flash/efficient kernels
            ki = ki.transpose(0, 1).repeat_interleave(group, dim=0)
            vi = vi.transpose(0, 1).repeat_interleave(group, dim=0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=causal, scale=scale)
            out[s : s + qlen] = oi.transpose(0, 1)
        return out
