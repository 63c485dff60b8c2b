"""The Transport interface: a worker's one door for moving KV blocks between pools.

Lifecycle (mirrors NIXL's own verbs):

    t = make_transport("nixl", agent_name)
    t.register(cache.raw, layout)          # once: the single contiguous KV region
    info = t.describe()                    # PeerInfo, travels inside every KVHandle
    # decode side, per request:
    t.connect(handle.source)               # idempotent; refuses a different layout (LayoutMismatch)
    stats = t.read(handle, local_blocks, timeout_s)   # pull, wait, verify state; TransferStats
    t.notify(handle.source.agent, handle.request_id)  # "you may free these blocks"
    # prefill side, in its loop:
    for request_id in t.poll_notifications(): free(request_id)
    t.close()                              # deregisters everything; idempotent

Invariants: after `close()` nothing stays registered; a failed or timed-out `read` releases its
transfer handles before raising; the transport never sees tokens or requests, only block ids.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from transport.wire import KVHandle, KVLayout, PeerInfo, TransferStats


class TransportError(RuntimeError):
    """A transfer could not be done (peer gone, backend error)."""


class LayoutMismatch(TransportError):
    """Two pools whose KV layouts differ; the message names the differing fields."""


class TransferTimeout(TransportError):
    """A transfer did not complete within its timeout (its handles have been released)."""


class Transport(ABC):
    backend: str = "abstract"

    def __init__(self, agent: str):
        self.agent = agent
        self.layout: KVLayout | None = None

    @abstractmethod
    def register(self, pool: torch.Tensor, layout: KVLayout) -> None:
        """Register the KV pool [num_blocks, block_bytes] uint8 (host or device memory)."""

    @abstractmethod
    def describe(self) -> PeerInfo: ...

    @abstractmethod
    def connect(self, peer: PeerInfo) -> None:
        """Make `peer` reachable. Raises LayoutMismatch if its layout differs from ours."""

    @abstractmethod
    def read(self, handle: KVHandle, local_blocks: list[int], timeout_s: float = 30.0) -> TransferStats:
        """Copy the handle's blocks from its source into `local_blocks` (same order, same count)."""

    @abstractmethod
    def notify(self, peer_agent: str, request_id: str) -> None:
        """Tell `peer_agent` that `request_id`'s blocks have been pulled."""

    @abstractmethod
    def poll_notifications(self) -> list[str]:
        """Request ids whose blocks peers have finished pulling (since the last poll)."""

    @abstractmethod
    def close(self) -> None: ...

    def check_layout(self, peer: PeerInfo) -> None:
        assert self.layout is not None, "register() first"
        diff = self.layout.differences(peer.layout)
        if diff:
            raise LayoutMismatch(f"KV layout of peer {peer.agent!r} differs from {self.agent!r}: " + "; ".join(diff))
