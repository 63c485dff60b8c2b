"""Paged decode attention in Triton, reading FP8 KV pages straight from the block-major pool.

One decode step: B sequences, one new query token each. Query head i attends with KV head
i // G (G = Hq / Hkv, the GQA group, as `repeat_interleave` in the torch reference). The pool is
the raw byte tensor of engine/kv/cache.py:

    raw [num_blocks, block_bytes] uint8, per block:
        data   [L, 2, block_size, Hkv, D]  e4m3 (or bf16 / fp32)
        scales [L, 2, block_size, Hkv]     fp32 (fp8 only)

The kernel never materialises dequantized K/V: it loads e4m3 K and V tiles, widens them to the
query dtype (exact: every e4m3 value is a bf16 value), and applies the per-token scale to the
scores (K) and to the probabilities (V), which is the same arithmetic as dequantizing first.

Work split ("flash decoding"): program (b, h, s) handles sequence b, KV head h and the s-th of
`num_splits` contiguous token ranges, for all G query heads of that KV head at once (so each K/V
byte is loaded once per group). Partial (max, sum, acc) are combined in `paged_decode`. Splits
keep the GPU busy when B * Hkv is small (batch 1 has only Hkv = 8 programs otherwise).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.kv.cache import KVCache


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D] query dtype
    kv_ptr,  # pool viewed in the page dtype: element (page, l, kv, t, h, d)
    scale_ptr,  # pool viewed as fp32 (fp8 pages only; else any pointer)
    tables_ptr,  # [B, max_blocks] int64 block tables
    ctx_ptr,  # [B] int32 context lengths (tokens visible, the new one included)
    m_ptr,
    l_ptr,  # [B, Hq, S] fp32 partial running max / sum
    acc_ptr,  # [B, Hq, S, D] fp32 partial numerators
    stride_qb,
    stride_qh,
    stride_tb,
    page_stride,
    kv_off,
    kv_stride,
    tok_stride,  # in page-dtype elements
    s_page_stride,
    s_off,
    s_kv_stride,  # in fp32 elements
    sm_scale,
    BLOCK_SIZE: tl.constexpr,
    H_KV: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    # contiguous token range [start, end) of this split, in whole BLOCK_N tiles
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = s * per_split
    end = tl.minimum(start + per_split, ctx)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    q_heads = h * G + offs_g  # [G_PAD]
    q = tl.load(
        q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None], other=0.0
    )  # [G_PAD, D]

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        valid = t < end
        page = tl.load(tables_ptr + b * stride_tb + t // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = (t % BLOCK_SIZE).to(tl.int64)
        base = page * page_stride + kv_off + slot * tok_stride + h * D  # K of (page, layer, slot, h)
        k = tl.load(kv_ptr + base[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(kv_ptr + kv_stride + base[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)))  # [G_PAD, BLOCK_N] fp32
        if IS_FP8:
            s_base = page * s_page_stride + s_off + slot * H_KV + h
            k_scale = tl.load(scale_ptr + s_base, mask=valid, other=0.0)
            v_scale = tl.load(scale_ptr + s_kv_stride + s_base, mask=valid, other=0.0)
            qk = qk * k_scale[None, :]
        qk = tl.where(valid[None, :], qk * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])  # [G_PAD, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if IS_FP8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    row = (b * (H_KV * G) + q_heads) * NUM_SPLITS + s  # [G_PAD] index into [B, Hq, S]
    tl.store(m_ptr + row, m_i, mask=g_ok)
    tl.store(l_ptr + row, l_i, mask=g_ok)
    tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_splits_for(batch: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Enough programs to cover every SM about twice, but no split shorter than 4 tiles.
    Depends only on static sizes (batch, capacity), so a CUDA graph can capture it."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = -(-2 * sms // (batch * num_kv_heads))
    cap = max(1, max_context // (4 * block_n))
    return max(1, min(want, cap, 64))


def paged_decode(
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (one new token per sequence, its K/V already in the pool) -> out [B, Hq, D].

    block_tables [B, max_blocks] (long, padded with any valid block id), context_lens [B] int32.
    No host synchronisation and no data-dependent shapes: safe inside CUDA-graph capture."""
    layout = cache.layout
    B, Hq, D = q.shape
    H, bs = layout.num_kv_heads, layout.block_size
    if Hq % H:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({H})")
    if D != layout.head_dim or D & (D - 1) or D < 16:
        raise ValueError(f"head_dim {D} must equal the pool's ({layout.head_dim}) and be a power of two >= 16")
    if layout.block_bytes % 4 or layout.data_bytes_per_block % 4:
        raise ValueError("pool block sizes must be multiples of 4 bytes (fp32 scales are read in place)")
    G = Hq // H
    q = q.contiguous()
    block_n = block_n or (64 if q.is_cuda else 16)
    max_ctx = block_tables.shape[1] * bs
    S = num_splits or num_splits_for(B, H, max_ctx, block_n, q.device)

    elem = layout.elem_bytes
    page_view = cache.raw.view(cache.data.dtype)  # [nb, block_bytes / elem]
    scale_view = cache.raw.view(torch.float32) if cache.is_fp8 else page_view
    tok_stride = H * D
    kv_stride = bs * tok_stride  # K -> V of the same layer
    kv_off = layer * 2 * kv_stride
    s_kv_stride = bs * H
    s_off = layout.data_bytes_per_block // 4 + layer * 2 * s_kv_stride

    m = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    acc = torch.empty(B, Hq, S, D, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(B, H, S)](
        q,
        page_view,
        scale_view,
        block_tables,
        context_lens,
        m,
        lsum,
        acc,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        layout.block_bytes // elem,
        kv_off,
        kv_stride,
        tok_stride,
        layout.block_bytes // 4,
        s_off,
        s_kv_stride,
        scale,
        BLOCK_SIZE=bs,
        H_KV=H,
        G=G,
        G_PAD=max(16, _next_pow2(G)),
        D=D,
        BLOCK_N=block_n,
        NUM_SPLITS=S,
        IS_FP8=cache.is_fp8,
    )
    # combine the splits: softmax over all tokens = weighted sum of per-split softmaxes
    m_all = m.amax(dim=-1, keepdim=True)  # [B, Hq, 1]; finite: split 0 always has a token
    w = torch.exp(m - m_all)  # empty splits: exp(-inf) = 0
    out = (acc * w.unsqueeze(-1)).sum(dim=2) / (lsum * w).sum(dim=-1, keepdim=True)
    return out.to(q.dtype)


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
