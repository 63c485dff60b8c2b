"""The paged KV pool: one contiguous byte tensor for all layers (see engine/kv/layout.py).

FP8 pages hold float8_e4m3fn values with one fp32 scale per (token, kv head): each token's K
and V are quantized on their own, so the cached bytes do not depend on how prompts were
batched or chunked. That is what lets whole, chunked and disaggregated prefill agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.layout import KVLayout

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TORCH_DTYPE = {"fp8": FP8, "bf16": torch.bfloat16, "fp32": torch.float32}


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 [..., D], fp32 scale [...]) with amax scaling over the last dim."""
    amax = x.abs().amax(dim=-1).float().clamp(min=1e-8)
    scale = amax / FP8_MAX
    q = (x.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


FP8_AS_FP16_SCALE = 256.0  # fp8_as_float16(x) * this == x.float(), exactly


def fp8_as_float16(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """e4m3fn -> float16 holding x / 256 exactly, in two-byte integer ops (half the traffic of the
    same trick on float32's four bytes; the decode step widens every cached K/V byte each layer).
    The 7 exponent/mantissa bits go to float16's bits 7..13 and the sign to bit 15: float16's
    exponent bias is 15, e4m3's 7, so the result is x * 2**-8, subnormals included. The caller
    folds the 256 into the per-token scales it applies anyway (a power of two: no rounding).
    `out`, int16 of x's shape (any strides), receives the bits: the conversion can write straight
    into the layout the matmul wants. Bit-exact with `x.float() / 256` for every finite value
    (the pool never holds NaN: writes clamp). Replaces a four-byte version of the same trick:
    measured on the dev VM (1 thread, a batch-8 SmolLM2 decode window): gather + widening per
    layer 0.83 -> 0.38 ms."""
    i = torch.empty(x.shape, dtype=torch.int16, device=x.device) if out is None else out
    i.copy_(x.view(torch.int8))  # sign-extended: bits 8..15 repeat the sign
    # << 7: the 7 value bits land on 7..13, the sign on 14 and 15; & ~bit14 keeps it on 15 only
    return i.bitwise_left_shift_(7).bitwise_and_(-16385).view(torch.float16)


@dataclass(frozen=True)
class SlotIndex:
    """A step's write positions in `KVCache._rows`, for any layer: block ids [2T] and rows
    [2T] of layer 0 (K rows, then V rows); layer l's rows are `rows + l * layer_stride`."""

    blocks: torch.Tensor
    rows: torch.Tensor
    layer_stride: int


class KVCache:
    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu"):
        self.layout = layout
        self.device = torch.device(device)
        L, H, D, bs, nb = layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, layout.num_blocks
        # The one region the transport registers.
        self.raw = torch.zeros(nb, layout.block_bytes, dtype=torch.uint8, device=self.device)
        dtype = _TORCH_DTYPE[layout.dtype]
        # data: [num_blocks, L, 2, block_size, H, D] (strided view into raw; rows are block_bytes apart)
        self.data = self.raw[:, : layout.data_bytes_per_block].view(dtype).view(nb, L, 2, bs, H, D)
        # scales: [num_blocks, L, 2, block_size, H] fp32, or None for bf16/fp32 pages
        self.scales = (
            self.raw[:, layout.data_bytes_per_block :].view(torch.float32).view(nb, L, 2, bs, H)
            if layout.scale_bytes_per_block
            else None
        )

        # the same bytes as [blocks, L * 2 * block_size, H * D] (and scales [..., H]): one token's
        # K (or V) of one layer is one row, addressed by (block, row): `write_at`'s two indices
        self._rows = self.data.view(nb, L * 2 * bs, H * D)
        self._scale_rows = None if self.scales is None else self.scales.view(nb, L * 2 * bs, H)

    @property
    def is_fp8(self) -> bool:
        return self.scales is not None

    def slot_index(self, slots: torch.Tensor) -> SlotIndex:
        """Where a step's K and V rows go, computed once per step for every layer's `write_at`."""
        bs = self.layout.block_size
        blk, off = slots // bs, slots % bs
        return SlotIndex(torch.cat([blk, blk]), torch.cat([off, off + bs]), 2 * bs)

    def write_at(self, layer: int, where: SlotIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """`write`, with the slots' indices precomputed, and K and V quantized and stored together
        (the same bytes: FP8 scales are per token and head): a decode step writes 30 layers of a
        few rows each, so the per-call work is all it costs."""
        T, H, D = k.shape
        kv = torch.cat([k, v])  # [2T, H, D]: K rows, then V rows, as `where` lists them
        rows = where.rows + layer * where.layer_stride
        if self.scales is not None:
            q, s = quantize_fp8(kv)
            assert self._scale_rows is not None
            self._rows.index_put_((where.blocks, rows), q.view(2 * T, H * D))
            self._scale_rows.index_put_((where.blocks, rows), s)
        else:
            self._rows.index_put_((where.blocks, rows), kv.view(2 * T, H * D).to(self.data.dtype))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, H, D] at flat slots [T] (slot = block * block_size + offset)."""
        bs = self.layout.block_size
        blk, off = slots // bs, slots % bs
        for kv_index, x in ((0, k), (1, v)):
            if self.scales is not None:  # fp8 pages
                q, s = quantize_fp8(x)
                self.data[blk, layer, kv_index, off] = q
                self.scales[blk, layer, kv_index, off] = s
            else:
                self.data[blk, layer, kv_index, off] = x.to(self.data.dtype)

    def gather(
        self, layer: int, block_table: torch.Tensor, length: int, out_dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V [length, H, D] of one sequence whose blocks are `block_table`."""
        n_blocks = -(-length // self.layout.block_size)
        blocks = block_table[:n_blocks]
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        # [n_blocks, 2, bs, H, D] -> [2, n_blocks*bs, H, D]
        raw = self.data[blocks, layer].transpose(0, 1).reshape(2, -1, H, D)[:, :length]
        if self.scales is None:
            pages = raw.to(out_dtype)
            return pages[0], pages[1]
        # fp8 pages. On CPU torch widens float8 one value at a time (and every subnormal byte takes
        # a microcode assist): a chunk's whole context, each layer, each chunk, was the larger part
        # of a long prompt's late chunks (SmolLM2, 2,048 tokens: 5.4 ms a layer). The two-byte
        # integer widening (x / 256 exactly, the 256 folded into the scales: a power of two, so
        # bit-identical) took 2.4 ms.
        s = self.scales[blocks, layer].transpose(0, 1).reshape(2, -1, H)[:, :length]
        if raw.device.type == "cpu":
            pages = fp8_as_float16(raw).to(out_dtype)
            s = s * FP8_AS_FP16_SCALE
        else:
            pages = raw.to(out_dtype)
        pages = pages * s.unsqueeze(-1).to(out_dtype)
        return pages[0], pages[1]

    def block_bytes_view(self, blocks: list[int]) -> torch.Tensor:
        """Raw bytes of the given blocks [n, block_bytes] (tests and verification)."""
        return self.raw[torch.as_tensor(blocks, dtype=torch.long, device=self.device)]
