"""WorkerHost: the class Ray turns into a worker actor, loadable without the worker code.

The router process must not import torch, and the worker classes (prefill_worker/, decode_worker/)
import the engine, hence torch. So the router hands Ray this thin class instead; the worker class
is named in `WORKER_CLASSES` (like a console-script entry point) and imported inside the actor
process, where `__init__` builds it. Every other method forwards one call of the worker contract
(`contracts.worker`), unchanged: exceptions reach the caller as the worker raised them.
"""

from __future__ import annotations

import importlib
from typing import Any

from contracts.worker import CacheEvents, GenerateRequest, PrefillResult, StreamEvent, WorkerStats
from transport.wire import PeerInfo, StreamTarget

# role -> "module:Class" of the worker that plays it
WORKER_CLASSES: dict[str, str] = {
    "prefill": "prefill_worker.worker:PrefillWorker",
    "decode": "decode_worker.worker:DecodeWorker",
    "colocated": "decode_worker.worker:DecodeWorker",
}


def load_worker_class(role: str) -> type:
    """Import the worker class for `role` (call it only where the worker will run)."""
    module, _, name = WORKER_CLASSES[role].partition(":")
    return getattr(importlib.import_module(module), name)


class WorkerHost:
    def __init__(self, role: str, *args: Any):
        self.worker: Any = load_worker_class(role)(*args)

    # PrefillWorkerAPI
    def prefill(self, req: GenerateRequest, stream: StreamTarget | None = None) -> PrefillResult:
        return self.worker.prefill(req, stream)

    def release(self, request_id: str) -> bool:
        return self.worker.release(request_id)

    def describe(self) -> PeerInfo:  # both roles (a decode worker's: for layer-wise streams)
        return self.worker.describe()

    # DecodeWorkerAPI
    def submit_prompt(self, req: GenerateRequest) -> None:
        self.worker.submit_prompt(req)

    def submit_prefilled(self, req: GenerateRequest, result: PrefillResult) -> None:
        self.worker.submit_prefilled(req, result)

    def open_stream(self, req: GenerateRequest, source: PeerInfo, layers_per_group: int) -> StreamTarget | None:
        return self.worker.open_stream(req, source, layers_per_group)

    def poll_events(self, timeout_s: float = 0.05) -> list[StreamEvent]:
        return self.worker.poll_events(timeout_s)

    # Worker
    def abort(self, request_id: str) -> bool:
        return self.worker.abort(request_id)

    def stats(self) -> WorkerStats:
        return self.worker.stats()

    def ping(self) -> str:
        return self.worker.ping()

    def cache_events(self) -> CacheEvents:
        return self.worker.cache_events()

    def shutdown(self) -> None:
        self.worker.shutdown()
