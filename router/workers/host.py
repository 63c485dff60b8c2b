"""WorkerHost: the class Ray turns into a worker actor, loadable without the worker code.

The router process must not import torch, and the worker classes (prefill_worker/, decode_worker/)
import the engine, hence torch. So the router hands Ray this thin class instead; the worker class
is named in `WORKER_CLASSES` (like a console-script entry point) and imported inside the actor
process, where `__init__` builds it. Every other method forwards one call of the worker contract
(`contracts.worker`), unchanged: exceptions reach the caller as the worker raised them.

Ray runs the host as a threaded actor whose methods are split into concurrency groups, each with
its own threads (`concurrency_groups`). A call that waits therefore never holds up a call of
another group: a health check's ping never queues behind prompts waiting for a step, and the
event poll never queues behind anything. It replaces one group of 512 threads
(`max_concurrency=512`), which had Ray start 514 threads in every worker process for calls that
are rarely more than a few at once.
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


# method -> its concurrency group. Each group is sized (CALLS_IN_FLIGHT) by how many of its calls
# the router can have in flight on one worker at once:
METHOD_GROUPS: dict[str, str] = {
    # answer at once, never wait on the engine: the health loop's ping, the stats refresh loop,
    # /metrics and /v1/workers/steps reads
    "ping": "control",
    "stats": "control",
    "describe": "control",
    # the decode worker's event long-poll (<= 50 ms): one pump per worker (router/lifecycle/worker_pools.py)
    "poll_events": "poll",
    # wait for the engine loop's next inbox drain, at most one engine step: one per request that
    # arrives during a step, its abort, a release, the prefix-cache sync
    "submit_prompt": "engine",
    "submit_prefilled": "engine",
    "open_stream": "engine",
    "abort": "engine",
    "release": "engine",
    "cache_events": "engine",
    "shutdown": "engine",
    # waits for the whole prompt: its queue on the worker and its prefill steps
    "prefill": "prefill",
}
# Calls beyond a group's size wait in Ray's queue for a free thread of that group, never for
# another group's. "prefill": a prefill step takes at most max_num_seqs prompts (64 by default)
# and max_prefill_tokens (8192); 32 prompts of 256 tokens fill a step, and on a CPU take seconds.
# More in flight on one worker wait in Ray's queue instead of the engine's (an abort meanwhile is
# remembered: prefill_worker/worker.py). "engine": arrivals beyond 16 in one step join at the
# next inbox drain, one step later.
CALLS_IN_FLIGHT: dict[str, int] = {"control": 4, "poll": 2, "engine": 16, "prefill": 32}


def concurrency_groups(role: str) -> dict[str, int]:
    """The groups of a worker playing `role`; the groups it never serves get one thread (Ray needs
    every group a method names to exist)."""
    unused = {"prefill": ("poll",), "decode": ("prefill",), "colocated": ("prefill",)}[role]
    return {g: 1 if g in unused else n for g, n in CALLS_IN_FLIGHT.items()}


def ray_actor_class(ray: Any, role: str) -> Any:
    """WorkerHost as a Ray actor class for `role`, its methods in their concurrency groups."""
    for name, group in METHOD_GROUPS.items():  # marks the function itself: the same every time
        ray.method(concurrency_group=group)(getattr(WorkerHost, name))
    return ray.remote(concurrency_groups=concurrency_groups(role))(WorkerHost)


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
