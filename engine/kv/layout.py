"""KVLayout: the byte layout of the paged KV pool, the contract between two workers' pools.

The whole pool is ONE contiguous byte tensor `[num_blocks, block_bytes]`, block-major:

    block b  = [ data: num_layers x 2 (K,V) x block_size x num_kv_heads x head_dim  (dtype) ]
               [ scales: num_layers x 2 x block_size x num_kv_heads                  (fp32)  ]  # fp8 only

Block-major (rather than one tensor per layer, as vLLM has) means a block id names one contiguous
byte range holding that block's K, V and FP8 scales for every layer. A run of consecutive block
ids is therefore one contiguous range: the transport ships a long prompt as a handful of large
descriptors, and the scales always travel with the bytes they scale.

Pure Python (no torch) so the router and transport can reason about layouts cheaply.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from engine.config import KV_DTYPE_BYTES, CacheConfig, ModelConfig

SCALE_BYTES = 4  # one fp32 scale per (layer, K|V, token, kv head) when dtype is fp8


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "fp8" (float8_e4m3fn) | "bf16" | "fp32"
    scale_layout: str  # "per_token_head_fp32" for fp8, "none" otherwise
    num_blocks: int  # pool size: not part of compatibility (pools of different sizes interoperate)

    @classmethod
    def build(cls, model: ModelConfig, cache: CacheConfig) -> KVLayout:
        return cls(
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            block_size=cache.block_size,
            dtype=cache.kv_dtype,
            scale_layout="per_token_head_fp32" if cache.kv_dtype == "fp8" else "none",
            num_blocks=cache.num_blocks,
        )

    @property
    def elem_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.dtype]

    @property
    def data_bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.elem_bytes

    @property
    def scale_bytes_per_block(self) -> int:
        if self.scale_layout == "none":
            return 0
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * SCALE_BYTES

    @property
    def block_bytes(self) -> int:
        return self.data_bytes_per_block + self.scale_bytes_per_block

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def layer_ranges(self, first: int, last: int) -> list[tuple[int, int]]:
        """Byte ranges (offset in a block, length) holding layers [first, last) of one block:
        their K/V data, then their FP8 scales. Layer l's data starts at l x data_bytes_per_block /
        num_layers, its scales at data_bytes_per_block + l x scale_bytes_per_block / num_layers.
        All layers: the whole block, one range."""
        if not 0 <= first < last <= self.num_layers:
            raise ValueError(f"layers [{first}, {last}) outside the {self.num_layers} layers")
        if (first, last) == (0, self.num_layers):
            return [(0, self.block_bytes)]
        per_data = self.data_bytes_per_block // self.num_layers
        ranges = [(first * per_data, (last - first) * per_data)]
        if self.scale_bytes_per_block:
            per_scale = self.scale_bytes_per_block // self.num_layers
            ranges.append((self.data_bytes_per_block + first * per_scale, (last - first) * per_scale))
        return ranges

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def compat_fields(self) -> dict:
        d = asdict(self)
        d.pop("num_blocks")
        return d

    @property
    def compat_hash(self) -> str:
        """Two pools can exchange blocks iff their hashes are equal."""
        blob = json.dumps(self.compat_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def differences(self, other: KVLayout) -> list[str]:
        """Human-readable list of fields that make `other` incompatible with self."""
        mine, theirs = self.compat_fields(), other.compat_fields()
        return [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
