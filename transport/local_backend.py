"""LocalTransport: the same verbs as NIXL, inside one process.

Pools register in a process-wide registry keyed by agent name; `read` copies byte ranges straight
between the two tensors (same coalescing as NIXL, so descriptor counts compare). Used by the
colocated mode and single-process tests; a peer in another process is unreachable by design.
"""

from __future__ import annotations

import threading
import time

import torch

from transport.base import TransferTimeout, Transport, TransportError
from transport.wire import KVHandle, KVLayout, PeerInfo, TransferStats

_LOCK = threading.Lock()
_POOLS: dict[str, tuple[torch.Tensor, KVLayout]] = {}  # agent -> registered pool
_INBOX: dict[str, list[bytes]] = {}  # agent -> messages sent to it, not yet received


def registered_agents() -> list[str]:
    """Agents with a pool in this process's registry (tests check close() empties it)."""
    with _LOCK:
        return sorted(_POOLS)


class LocalTransport(Transport):
    backend = "local"

    def __init__(self, agent: str):
        super().__init__(agent)
        self._pool: torch.Tensor | None = None
        self._peers: dict[str, PeerInfo] = {}
        self._closed = False

    def register(self, pool: torch.Tensor, layout: KVLayout) -> None:
        self._check_open()
        self._check_pool(pool, layout)
        with _LOCK:
            if self.agent in _POOLS:
                raise TransportError(f"agent name {self.agent!r} already registered in this process")
            _POOLS[self.agent] = (pool, layout)
            _INBOX.setdefault(self.agent, [])
        self._pool, self.layout = pool, layout

    def connect(self, peer: PeerInfo) -> None:
        self._check_open()
        if peer.backend != self.backend:
            raise TransportError(f"peer {peer.agent!r} speaks {peer.backend!r}, this agent speaks 'local'")
        self.check_layout(peer)
        self._remote_pool(peer.agent)  # must be alive in this process
        self._peers[peer.agent] = peer

    def read(
        self, handle: KVHandle, local_blocks: list[int], timeout_s: float = 30.0, coalesced: bool = True
    ) -> TransferStats:
        self._check_read(handle)
        assert self._pool is not None  # registered, as _check_read found
        self.connect(handle.source)
        remote, remote_layout = self._remote_pool(handle.agent)
        runs = self.handle_runs(handle, local_blocks, remote_layout.num_blocks, coalesced)
        src, dst = remote.view(-1), self._pool.view(-1)
        deadline = time.perf_counter() + timeout_s
        t0 = time.perf_counter()
        for i, r in enumerate(runs):
            # Copies are synchronous; the deadline is checked between runs so a huge uncoalesced
            # transfer still honours it. Nothing to release: no handles exist.
            if i and time.perf_counter() > deadline:
                raise TransferTimeout(
                    f"request {handle.request_id!r}: local copy from {handle.agent!r} "
                    f"not done within {timeout_s}s ({i}/{len(runs)} ranges copied)"
                )
            dst[r.local_offset : r.local_offset + r.nbytes].copy_(src[r.remote_offset : r.remote_offset + r.nbytes])
        if dst.is_cuda:
            torch.cuda.synchronize(dst.device)
        seconds = time.perf_counter() - t0
        verify_s = self._verify_read(handle, local_blocks)
        stats = TransferStats.build(
            handle.request_id, self.backend, self.moved_bytes(handle, len(local_blocks)), len(runs), seconds
        )
        stats.verify_s = verify_s
        return stats

    def _send(self, peer_agent: str, message: bytes) -> None:
        self._check_open()
        with _LOCK:
            if peer_agent not in _INBOX:
                raise TransportError(f"notify: peer {peer_agent!r} is not registered in this process")
            _INBOX[peer_agent].append(message)

    def _receive(self) -> list[bytes]:
        self._check_open()
        with _LOCK:
            out, _INBOX[self.agent] = _INBOX.get(self.agent, []), []
        return out

    @property
    def registered(self) -> bool:
        return self._pool is not None

    def close(self) -> None:
        if self._closed:
            return
        with _LOCK:
            if self._pool is not None and _POOLS.get(self.agent, (None,))[0] is self._pool:
                del _POOLS[self.agent]
                _INBOX.pop(self.agent, None)
        self._pool, self._peers, self._closed = None, {}, True

    def _remote_pool(self, agent: str) -> tuple[torch.Tensor, KVLayout]:
        with _LOCK:
            entry = _POOLS.get(agent)
        if entry is None:
            raise TransportError(f"peer {agent!r} has no pool registered in this process (closed or remote)")
        return entry

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self.agent!r} is closed")
