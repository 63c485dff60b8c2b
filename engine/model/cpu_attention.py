"""BatchedAttention: the CPU hot path, the reference's semantics without its per-sequence loop.

Decode rows (one new token) of a step run as a few batched calls: their pages are gathered into
a padded [rows, W * block_size] window (W = blocks of the step's longest context) and attended
at once, with a mask hiding each row's padding. Rows go in groups of `rows_per_group` so one
group's dequantized K/V stay in the CPU caches (one 256-row window is ~20 MB for `tiny`; the
grouped version measured 2-3x faster). The grouped query heads of one KV head share their K/V
(q viewed [rows, Hkv, G, D]), so K/V are never repeated per group.

FP8 pages: K and V are widened exactly, as float16 holding x / 256 (`fp8_as_float16`: two-byte
integer ops), then to float32; the per-token scales, times 256, are applied to the scores (K)
and to the probabilities (V), as the Triton kernel does; this is the reference's arithmetic up
to float rounding order (the 256 is a power of two: the result is bit-identical to widening
straight to float32).

The windows, masks and K/V write positions depend only on the step, so `prepare` builds them
once per step and every layer reuses them. Prefill rows (several new tokens) are compute-bound
and few per step; they go one sequence at a time, like the reference, but as one 4-D SDPA call
with grouped-query heads (`enable_gqa`), which CPU torch sends to its flash kernel: the
reference's 3-D call with K/V repeated per query head takes the math path, measured 3.7x slower
for a 128-token SmolLM2 prompt, with bit-identical output (and chunk rows equal to the whole
prompt's rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv.cache import FP8_AS_FP16_SCALE, KVCache, SlotIndex, fp8_as_float16
from engine.model.attention import AttentionMetadata, TorchReferenceAttention
from engine.model.cpu_kernels import paged_decode_op


@dataclass
class _RowGroup:
    rows: slice  # decode rows of this group (positions in the step's decode order)
    tables: torch.Tensor  # [n, W] long: each row's blocks, padded
    lens: torch.Tensor  # [n] int32: each row's context length
    hidden: torch.Tensor  # [1, n, 1, W * block_size] bool: key t is padding (t >= context length)


@dataclass
class _StepState:
    slots: SlotIndex  # where every layer writes the step's K/V
    tokens: torch.Tensor | None  # [Bd] rows of q that are decode tokens (None: all, in order)
    groups: list[_RowGroup]
    prefill: list[tuple[int, int, int, int]]  # (first token row, query len, context len, sequence)


@functools.cache
def _kv_factors(scale: float, device: torch.device) -> torch.Tensor:
    """[2, 1, 1, 1, 1]: what the K and V scales are multiplied by (the widening's 256; the
    softmax scale on K's side). Made once per (scale, device), read-only."""
    return torch.tensor([FP8_AS_FP16_SCALE * scale, FP8_AS_FP16_SCALE], device=device).view(2, 1, 1, 1, 1)


class BatchedAttention(TorchReferenceAttention):
    def __init__(self, rows_per_group: int = 64, kernel: bool = True):
        """`kernel`: decode rows over FP8 pages go to the C++ kernel where it is built
        (engine/model/cpu_kernels.py); False keeps them in torch ops (the kernel's oracle in tests)."""
        self.rows_per_group = rows_per_group
        self.kernel = paged_decode_op() if kernel else None

    def prepare(self, meta: AttentionMetadata, cache: KVCache) -> None:
        bs = cache.layout.block_size
        prefill: list[tuple[int, int, int, int]] = []
        if meta.is_decode_only:
            tokens = None
            tables, lens, ctx_d = meta.block_tables, meta.context_lens_t, meta.context_lens
        else:
            seq_list, tok_list = [], []
            start = 0
            for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
                if qlen == 1:
                    seq_list.append(i)
                    tok_list.append(start)
                else:
                    prefill.append((start, qlen, ctx, i))
                start += qlen
            dev = meta.block_tables.device
            seqs = torch.tensor(seq_list, dtype=torch.long, device=dev)
            tokens = torch.tensor(tok_list, dtype=torch.long, device=dev)
            tables, lens = meta.block_tables[seqs], meta.context_lens_t[seqs]
            ctx_d = [meta.context_lens[i] for i in seq_list]
        groups = []
        for g0 in range(0, len(ctx_d), self.rows_per_group):
            g1 = min(g0 + self.rows_per_group, len(ctx_d))
            width = -(-max(ctx_d[g0:g1]) // bs)  # this group's longest context, in blocks
            t = torch.arange(width * bs, device=lens.device)
            hidden = t[None, :] >= lens[g0:g1, None].long()
            groups.append(_RowGroup(slice(g0, g1), tables[g0:g1, :width], lens[g0:g1].int(), hidden[None, :, None, :]))
        meta.backend_state = _StepState(cache.slot_index(meta.slot_mapping), tokens, groups, prefill)

    def forward(self, layer, q, k, v, cache, meta, scale):
        if not isinstance(meta.backend_state, _StepState):  # a caller that skipped prepare (one layer)
            self.prepare(meta, cache)
        st: _StepState = meta.backend_state
        cache.write_at(layer, st.slots, k, v)
        if st.tokens is None and len(st.groups) == 1:  # a decode-only step of one group: its output
            return self._decode(layer, q, cache, st.groups[0], scale)
        out = torch.empty_like(q)
        q_d = q if st.tokens is None else q[st.tokens]
        out_d = out if st.tokens is None else torch.empty_like(q_d)
        for g in st.groups:
            out_d[g.rows] = self._decode(layer, q_d[g.rows], cache, g, scale)
        if st.tokens is not None:
            out[st.tokens] = out_d
        for start, qlen, ctx, i in st.prefill:
            out[start : start + qlen] = self._prefill(
                layer, q[start : start + qlen], cache, meta.block_tables[i], ctx, scale
            )
        return out

    @staticmethod
    def _prefill(
        layer: int, q: torch.Tensor, cache: KVCache, block_table: torch.Tensor, ctx: int, scale: float
    ) -> torch.Tensor:
        """One sequence's qlen new tokens, the last of its ctx positions: q [qlen, Hq, D] -> out
        [qlen, Hq, D], causal with an offset for the cached prefix (`attend_one`'s semantics)."""
        qlen = q.shape[0]
        kc, vc = cache.gather(layer, block_table, ctx, out_dtype=q.dtype)  # [ctx, Hkv, D]
        q_pos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos  # [qlen, ctx]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            kc.transpose(0, 1)[None],
            vc.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )  # [1, Hq, qlen, D]
        return o[0].transpose(0, 1)

    def _decode(self, layer: int, q: torch.Tensor, cache: KVCache, g: _RowGroup, scale: float) -> torch.Tensor:
        """q [n, Hq, D] -> out [n, Hq, D] over the group's padded page window."""
        n, Hq, D = q.shape
        H = cache.layout.num_kv_heads
        if self.kernel is not None and cache.scales is not None and q.dtype == torch.float32 and q.device.type == "cpu":
            # the pool's pages and scales of this layer, as the kernel reads them (no copies)
            pages = cache.data[:, layer].view(torch.uint8)
            return self.kernel(q, pages, cache.scales[:, layer], g.tables, g.lens, scale)
        blocks = g.tables.flatten()
        # The pool is [blocks, L, 2, bs, H, D]: a page's K and V for one layer are one contiguous
        # run, so the gather copies whole runs ([n*W, 2, bs, H, D]); the widening then writes
        # KV head outermost ([2, H, n*W, bs, D]) so each head's [n, T, D] keys are one batch of
        # contiguous matrices for the matmul, with no permuted copy of its own.
        pages = cache.data[:, layer].index_select(0, blocks)
        if cache.scales is not None:  # fp8: x / 256 as float16 (exact), the 256 joins the scales
            bits = torch.empty(2, H, blocks.shape[0], pages.shape[2], D, dtype=torch.int16, device=q.device)
            fp8_as_float16(pages, out=bits.permute(2, 0, 3, 1, 4))
            kv = bits.view(torch.float16).view(2, H, n, -1, D).to(q.dtype)
        else:  # one pass: widened (if bf16) straight into the head-outermost layout
            kv = torch.empty(2, H, blocks.shape[0], pages.shape[2], D, dtype=q.dtype, device=q.device)
            kv.permute(2, 0, 3, 1, 4).copy_(pages)
            kv = kv.view(2, H, n, -1, D)
        qh = q.view(n, H, Hq // H, D).transpose(0, 1)  # [H, n, G, D]; query head h*G + g uses KV head h
        scores = torch.matmul(qh, kv[0].transpose(-1, -2))  # [H, n, G, T]
        if cache.scales is not None:  # fp8: per-token K scale on the scores, V scale on the probs
            s = cache.scales[:, layer].index_select(0, blocks)  # [n*W, 2, bs, H]
            # one pass: K's scales times 256 * scale, V's times 256 (multiplying by 256 is exact,
            # so the scores and outputs are bit-identical to widening straight to float32)
            s = s.permute(1, 3, 0, 2).reshape(2, H, n, 1, -1) * _kv_factors(scale, s.device)
            scores.mul_(s[0])
        else:
            scores.mul_(scale)
        probs = scores.masked_fill_(g.hidden, float("-inf")).softmax(dim=-1)
        if cache.scales is not None:
            probs.mul_(s[1])
        return torch.matmul(probs, kv[1]).transpose(0, 1).reshape(n, Hq, D)
