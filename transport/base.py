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

Layer-wise streaming adds one message kind on the same channel, the other way round: the prefill
side `connect`s to the decode worker and `send_progress(peer, StreamProgress)` as each group of
layers is written; the decode side `poll_progress()`es and pulls each group with `read` of a
handle whose `layers` name the slice. Both kinds share one notification channel per agent
(`_send`/`_receive`, a backend's two primitives), told apart by their first byte.

Invariants: after `close()` nothing stays registered; a failed or timed-out `read` releases its
transfer handles before raising; the transport never sees tokens or requests, only block ids.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from transport.coalesce import check_blocks, coalesce
from transport.integrity import block_checksums, mismatched_blocks
from transport.wire import KVHandle, KVLayout, PeerInfo, StreamProgress, TransferStats

if TYPE_CHECKING:  # the interface names torch only in annotations: the wire types stay torch-free
    import torch


class TransportError(RuntimeError):
    """A transfer could not be done (peer gone, backend error, corrupt KV)."""


class LayoutMismatch(TransportError):
    """Two pools whose KV layouts differ; the message names the differing fields."""


class KVChecksumMismatch(TransportError):
    """Pulled blocks differ from what the holder wrote (transport/integrity.py); the request
    must not be decoded from them."""


class TransferTimeout(TransportError):
    """A transfer did not complete within its timeout (its handles have been released)."""


_RELEASE, _PROGRESS = b"R", b"P"  # the first byte of a notification: which kind it is


class Transport(ABC):
    backend: str = "abstract"

    def __init__(self, agent: str):
        self.agent = agent
        self.layout: KVLayout | None = None
        self._pool: torch.Tensor | None = None  # the registered KV pool
        self._releases: list[str] = []  # received, not yet polled (see _sort_notifications)
        self._progress: list[StreamProgress] = []
        self._inbox_lock = threading.Lock()

    @abstractmethod
    def register(self, pool: torch.Tensor, layout: KVLayout) -> None:
        """Register the KV pool [num_blocks, block_bytes] uint8 (host or device memory)."""

    def describe(self) -> PeerInfo:
        """What a peer needs to reach this agent's registered pool (every backend's the same but
        for `_metadata`)."""
        self._check_open()
        if self._pool is None or self.layout is None:
            raise TransportError("register() the KV pool before describe()")
        return PeerInfo(
            agent=self.agent,
            backend=self.backend,
            layout=self.layout,
            metadata=self._metadata(),
            base_addr=self._pool.data_ptr(),
            device_id=max(self._pool.get_device(), 0),
            mem_type="VRAM" if self._pool.is_cuda else "DRAM",
        )

    def _metadata(self) -> bytes:
        """The backend's own part of `describe()` (NIXL's agent metadata); none by default."""
        return b""

    @abstractmethod
    def connect(self, peer: PeerInfo) -> None:
        """Make `peer` reachable. Raises LayoutMismatch if its layout differs from ours."""

    @abstractmethod
    def read(
        self, handle: KVHandle, local_blocks: list[int], timeout_s: float = 30.0, coalesced: bool = True
    ) -> TransferStats:
        """Copy the handle's blocks from its source into `local_blocks` (same order, same count),
        connecting first if needed. Runs of consecutive ids travel as one descriptor unless
        `coalesced=False` (one per block: the benchmark's baseline). Raises TransferTimeout
        after `timeout_s`, TransportError if the peer is dead, ValueError for bad block ids."""

    @abstractmethod
    def _send(self, peer_agent: str, message: bytes) -> None:
        """Deliver `message` to `peer_agent`'s notification inbox (connect to it first)."""

    @abstractmethod
    def _receive(self) -> list[bytes]:
        """Messages peers sent to this agent since the last call, in arrival order."""

    def notify(self, peer_agent: str, request_id: str) -> None:
        """Tell `peer_agent` that `request_id`'s blocks have been pulled."""
        self._send(peer_agent, _RELEASE + request_id.encode())

    def send_progress(self, peer_agent: str, progress: StreamProgress) -> None:
        """Layer-wise streaming: tell the decode worker `peer_agent` that a group is written."""
        self._send(peer_agent, _PROGRESS + progress.encode())

    def poll_notifications(self) -> list[str]:
        """Request ids whose blocks peers have finished pulling (since the last poll)."""
        with self._inbox_lock:
            self._sort_notifications()
            out, self._releases = self._releases, []
        return out

    def poll_progress(self) -> list[StreamProgress]:
        """Layer-wise progress messages received since the last poll, in arrival order."""
        with self._inbox_lock:
            self._sort_notifications()
            out, self._progress = self._progress, []
        return out

    def _sort_notifications(self) -> None:
        for m in self._receive():
            if m[:1] == _PROGRESS:
                self._progress.append(StreamProgress.decode(m[1:]))
            else:
                self._releases.append(m[1:].decode())

    @abstractmethod
    def close(self) -> None: ...

    @property
    def registered(self) -> bool:
        """True while a pool is registered (False again after close())."""
        return self.layout is not None

    def slice_checksums(self, block_ids: list[int], layers: tuple[int, int]) -> tuple[int, ...]:
        """Checksums of layers [first, last) of each of `block_ids` in the registered pool (a
        layer-wise group's --verify-kv sums, made where the KV was written)."""
        if self.layout is None or self._pool is None:
            raise TransportError("register() the KV pool before checksumming it")
        return block_checksums(self._pool, block_ids, self.layout.layer_ranges(*layers))

    def make_handle(
        self, request_id: str, block_ids: list[int], num_tokens: int, lease_s: float = 60.0, checksum: bool = False
    ) -> KVHandle:
        """The KVHandle a holder gives out for blocks of its registered pool. `checksum`: include
        one checksum per block (the KV must be written already), so that the reader verifies."""
        if self.layout is None or self._pool is None:
            raise TransportError("register() the KV pool before making handles")
        if self.layout.blocks_for(num_tokens) != len(block_ids):
            raise ValueError(
                f"{num_tokens} tokens need {self.layout.blocks_for(num_tokens)} blocks of "
                f"{self.layout.block_size}, got {len(block_ids)}"
            )
        sums = block_checksums(self._pool, block_ids) if checksum else ()
        return KVHandle(
            request_id,
            self.describe(),
            tuple(block_ids),
            num_tokens,
            self.layout.compat_hash,
            time.time() + lease_s,
            sums,
        )

    def _verify_read(self, handle: KVHandle, local_blocks: list[int]) -> float:
        """After a read: if the handle carries checksums, check the received blocks against them
        (raises KVChecksumMismatch). Returns the seconds it took (0 without checksums)."""
        if not handle.checksums:
            return 0.0
        assert self._pool is not None  # read() checked registration
        t0 = time.perf_counter()
        ranges = self.layout.layer_ranges(*handle.layers) if handle.layers is not None and self.layout else None
        bad = mismatched_blocks(self._pool, local_blocks, handle.checksums, ranges)
        if bad:
            shown = ", ".join(f"#{i} (local block {local_blocks[i]})" for i in bad[:4])
            shown += " ..." if len(bad) > 4 else ""
            what = f"layers {handle.layers[0]}-{handle.layers[1] - 1} of " if handle.layers is not None else ""
            raise KVChecksumMismatch(
                f"request {handle.request_id!r}: KV integrity check failed: {what}{len(bad)} of {len(local_blocks)} "
                f"blocks pulled from {handle.agent!r} differ from what it wrote ({shown}); not decoded"
            )
        return time.perf_counter() - t0

    @staticmethod
    def _check_pool(pool: torch.Tensor, layout: KVLayout) -> None:
        """register()'s precondition in every backend: the pool is `layout`'s blocks as one byte tensor."""
        import torch  # noqa: PLC0415 - only a backend's register() gets here; the wire types stay torch-free

        want = (layout.num_blocks, layout.block_bytes)
        if pool.dtype != torch.uint8 or tuple(pool.shape) != want or not pool.is_contiguous():
            raise ValueError(
                f"pool must be a contiguous uint8 tensor of shape {want}, got {pool.dtype} {tuple(pool.shape)}"
            )

    @abstractmethod
    def _check_open(self) -> None:
        """Raise TransportError if close() has run."""

    def _check_read(self, handle: KVHandle) -> KVLayout:
        """The preconditions every backend's read() shares: still open, a pool registered, and a
        handle made for a pool of this layout (the hash is cheap; connect() diffs the full layout).
        Returns the registered layout."""
        self._check_open()
        if not self.registered:
            raise TransportError("register() the KV pool before read()")
        assert self.layout is not None  # registered implies a layout
        if handle.layout_hash != self.layout.compat_hash:
            raise TransportError(
                f"handle {handle.request_id!r} has layout hash {handle.layout_hash}, "
                f"this pool {self.layout.compat_hash}"
            )
        return self.layout

    def handle_runs(self, handle: KVHandle, local_blocks: list[int], remote_num_blocks: int, coalesced: bool) -> list:
        """The byte ranges (transport.coalesce.Run) a read of `handle` into `local_blocks` moves:
        whole blocks, or the slice of each that the handle's `layers` name."""
        assert self.layout is not None  # _check_read ran
        check_blocks(handle.block_ids, local_blocks, remote_num_blocks, self.layout.num_blocks)
        ranges = self.layout.layer_ranges(*handle.layers) if handle.layers is not None else None
        return coalesce(handle.block_ids, local_blocks, self.layout.block_bytes, enabled=coalesced, ranges=ranges)

    def moved_bytes(self, handle: KVHandle, num_blocks: int) -> int:
        """Bytes a read of `num_blocks` blocks of `handle` moves."""
        assert self.layout is not None
        if handle.layers is None:
            return num_blocks * self.layout.block_bytes
        return num_blocks * sum(n for _, n in self.layout.layer_ranges(*handle.layers))

    def check_layout(self, peer: PeerInfo) -> None:
        assert self.layout is not None, "register() first"
        diff = self.layout.differences(peer.layout)
        if diff:
            raise LayoutMismatch(f"KV layout of peer {peer.agent!r} differs from {self.agent!r}: " + "; ".join(diff))
