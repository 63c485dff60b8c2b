"""Wire types that cross process boundaries: what a decode worker needs to pull a prompt's KV.

Typed, frozen dataclasses (pickled by Ray, JSON-able for logs). The router passes them from
prefill to decode without looking inside.
"""

from __future__ import annotations

import base64
import time
from dataclasses import asdict, dataclass, field

from engine.kv_layout import KVLayout

__all__ = ["KVLayout", "PeerInfo", "KVHandle", "TransferStats", "LINKS_GBPS"]

# The article's link table (GB/s, 1 GB = 1e9 bytes).
LINKS_GBPS: dict[str, float] = {"nvlink": 900.0, "ib-400g": 50.0, "ib-100g": 12.5}


@dataclass(frozen=True)
class PeerInfo:
    """Everything a peer needs to connect to this transport endpoint."""

    agent: str  # unique agent name
    backend: str  # "nixl" | "local"
    layout: KVLayout
    metadata: bytes = b""  # backend-specific (NIXL agent metadata blob)
    # Where the registered pool starts in the owner's address space: a reader addresses block b
    # of this peer at base_addr + b * layout.block_bytes.
    base_addr: int = 0
    device_id: int = 0  # GPU ordinal for VRAM pools, 0 for host memory
    mem_type: str = "DRAM"  # "DRAM" (host) | "VRAM" (GPU)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["metadata"] = base64.b64encode(self.metadata).decode()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PeerInfo:
        d = dict(d)
        d["layout"] = d["layout"] if isinstance(d["layout"], KVLayout) else KVLayout.from_dict(d["layout"])
        d["metadata"] = base64.b64decode(d.get("metadata", ""))
        return cls(**d)


@dataclass(frozen=True)
class KVHandle:
    """A prompt's KV held by a prefill worker under a lease, ready to be pulled."""

    request_id: str
    source: PeerInfo  # who holds the blocks (and how to reach them)
    block_ids: tuple[int, ...]  # in token order: block i holds tokens [i*bs, (i+1)*bs)
    num_tokens: int  # prompt tokens whose KV is in those blocks (last block may be partial)
    layout_hash: str
    lease_deadline: float  # time.time() after which the holder may free the blocks
    # One checksum per block (transport/integrity.py), computed by the holder after writing the
    # KV; empty when --verify-kv is off. A read() verifies the pulled blocks against them.
    checksums: tuple[int, ...] = ()

    @property
    def agent(self) -> str:
        return self.source.agent

    def expired(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) > self.lease_deadline

    def to_dict(self) -> dict:
        d = asdict(self)
        d["source"] = self.source.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> KVHandle:
        d = dict(d)
        d["source"] = PeerInfo.from_dict(d["source"])
        d["block_ids"] = tuple(d["block_ids"])
        d["checksums"] = tuple(d.get("checksums", ()))
        return cls(**d)


@dataclass
class TransferStats:
    """One transfer, as the router's timeline and metrics report it."""

    request_id: str
    backend: str
    bytes: int
    descriptors: int
    seconds: float
    link_ms: dict[str, float] = field(default_factory=dict)  # same bytes on the article's links
    verify_s: float = 0.0  # checksumming the received blocks (--verify-kv), not in `seconds`

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    @classmethod
    def build(cls, request_id: str, backend: str, nbytes: int, descriptors: int, seconds: float) -> TransferStats:
        return cls(
            request_id,
            backend,
            nbytes,
            descriptors,
            seconds,
            {name: nbytes / (gbps * 1e9) * 1e3 for name, gbps in LINKS_GBPS.items()},
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gbytes_per_s"] = self.gbytes_per_s
        return d
