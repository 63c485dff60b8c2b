"""KV transport: wire types, the Transport interface and its backends (see transport/base.py)."""

from __future__ import annotations

from typing import Any

from transport.base import KVChecksumMismatch, LayoutMismatch, TransferTimeout, Transport, TransportError
from transport.wire import LINKS_GBPS, KVHandle, KVLayout, PeerInfo, TransferStats

BACKENDS = ("nixl", "local")


def make_transport(backend: str, agent: str, **options: Any) -> Transport:
    """A transport endpoint named `agent`. `options` go to the backend's constructor
    (nixl: progress_thread=True|False, streams=N)."""
    if backend == "nixl":
        from transport.nixl_backend import NixlTransport  # noqa: PLC0415 - imports NIXL only when used

        return NixlTransport(agent, **options)
    if backend == "local":
        from transport.local_backend import LocalTransport  # noqa: PLC0415 - imports torch only when used

        if options:
            raise TypeError(f"the local transport takes no options, got {sorted(options)}")
        return LocalTransport(agent)
    raise ValueError(f"unknown transport backend {backend!r}; choose one of {', '.join(BACKENDS)}")


__all__ = [
    "make_transport",
    "BACKENDS",
    "Transport",
    "TransportError",
    "LayoutMismatch",
    "TransferTimeout",
    "KVChecksumMismatch",
    "KVLayout",
    "KVHandle",
    "PeerInfo",
    "TransferStats",
    "LINKS_GBPS",
]
