"""Wire types that cross process boundaries: what a decode worker needs to pull a prompt's KV.

Typed, frozen dataclasses (pickled by Ray, JSON-able for logs). The router passes them from
prefill to decode without looking inside.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import asdict, dataclass, field

from engine.kv.layout import KVLayout

__all__ = ["KVLayout", "PeerInfo", "KVHandle", "TransferStats", "StreamTarget", "StreamProgress", "LINKS_GBPS"]

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
    # Layer-wise streaming: only layers [first, last) of each block (KVLayout.layer_ranges); the
    # checksums then cover that slice. None: every layer (the whole block).
    layers: tuple[int, int] | None = None

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
        d["layers"] = tuple(d["layers"]) if d.get("layers") is not None else None
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
    # "bulk": one pull once the prefill ended; "layerwise": one pull per group of layers (and per
    # prefill chunk) while the prefill still ran, `seconds` their sum and `groups` their count
    mode: str = "bulk"
    groups: int = 1
    start_unix: float = 0.0  # when the first pull started (wall clock on the decode worker)
    end_unix: float = 0.0  # when the last pull ended: the KV is whole on the decode worker
    # layer-wise: each pull as (first layer, last layer + 1, start unix, end unix, bytes), in order
    group_spans: list[tuple[int, int, float, float, int]] = field(default_factory=list)

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


@dataclass(frozen=True)
class StreamTarget:
    """Where a layer-wise request's KV goes: the decode worker that reserved blocks for it
    (`DecodeWorker.open_stream`). The prefill worker announces each group of layers to `peer` as
    it is written; the decode worker pulls it at once."""

    request_id: str
    peer: PeerInfo  # the decode worker's transport endpoint (progress messages go there)
    layers_per_group: int  # layers announced together (--kv-stream-layers)
    hit_blocks: int = 0  # leading blocks the decode side's prefix cache already holds (not pulled)


@dataclass(frozen=True)
class StreamProgress:
    """One progress message from a prefill worker to the decode worker it streams to.

    kind "group": layers [layers[0], layers[1]) of the prompt's blocks first_block ..
    first_block + len(block_ids) - 1 are written and final (`block_ids` are the prefill pool's;
    `checksums`, with --verify-kv, one per block over that slice). kind "done": the prompt is
    prefilled and every group announced; `first_token` is its first generated token and
    `lease_deadline` when the prefill side frees its copy. kind "failed": the prefill gave up on
    it (`error` says why); the decode side frees its blocks."""

    request_id: str
    kind: str  # "group" | "done" | "failed"
    layers: tuple[int, int] = (0, 0)
    first_block: int = 0
    block_ids: tuple[int, ...] = ()
    checksums: tuple[int, ...] = ()
    t: float = 0.0  # wall clock on the prefill worker when it was sent
    first_token: int = -1
    lease_deadline: float = 0.0
    error: str = ""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, blob: bytes) -> StreamProgress:
        d = json.loads(blob)
        d["layers"] = tuple(d["layers"])
        d["block_ids"] = tuple(d["block_ids"])
        d["checksums"] = tuple(d["checksums"])
        return cls(**d)
