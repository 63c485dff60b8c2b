"""Which worker of a pool serves a request: the router's placement policies, and the prefix index
the prefix policy (and auto's pricing) reads.

Policies: round_robin; least_loaded (router-assigned requests + queue depth, then free KV blocks);
prefix (the worker holding the longest cached prefix of the request, from a PrefixIndex fed by the
workers' cache events; ties and misses go to the least loaded). Auto mode (router/dispatch/dispatcher.py)
decides local or remote on top of the worker each pool's policy picked.
"""

from __future__ import annotations

import asyncio
import itertools

from contracts.worker import WorkerStats
from engine.kv.prefix_cache import block_hashes
from router.lifecycle.prefix_index import PrefixIndex
from router.workers.handle import WorkerHandle

POLICIES = ("round_robin", "least_loaded", "prefix")


class Placement:
    def __init__(self, policy: str, block_size: int, hashes_wanted: bool):
        if policy not in POLICIES:
            raise ValueError(f"policy must be round_robin, least_loaded or prefix, got {policy!r}")
        self.policy, self.block_size = policy, block_size
        # the prefix policy matches a prompt's blocks; auto prices a prompt after the prefix each
        # side already caches
        self.hashes_wanted = hashes_wanted or policy == "prefix"
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self.worker_stats: dict[str, WorkerStats] = {}  # by worker name, as the last stats() read them
        self.prefix_index = PrefixIndex()  # which worker caches which blocks
        # one drain at a time per worker: draining is destructive, and two drains applied out of
        # order could re-add an evicted hash (or drop a stored one)
        self._sync_locks: dict[str, asyncio.Lock] = {}

    def hashes(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's block hashes, where the policy (or auto) looks prefixes up; else none."""
        return block_hashes(prompt_ids, self.block_size) if self.hashes_wanted else []

    def matched_blocks(self, w: WorkerHandle, hashes: list[int]) -> int:
        return self.prefix_index.matched_blocks(w.name, hashes)

    def pick(self, workers: list[WorkerHandle], role: str, hashes: list[int]) -> WorkerHandle:
        alive = [w for w in workers if w.alive] or workers
        if self.policy == "round_robin":
            return alive[next(self._rr[role]) % len(alive)]
        if self.policy == "prefix":
            return min(alive, key=lambda w: (-self.matched_blocks(w, hashes), self._load(w)))
        return min(alive, key=self._load)

    def _load(self, w: WorkerHandle) -> tuple[int, int]:
        s = self.worker_stats.get(w.name)
        return (w.active + (s.queue_depth if s else 0), -(s.blocks_free if s else 0))

    def why(self, w: WorkerHandle, hashes: list[int]) -> str:
        """The policy's reason for picking `w` (a trace's dispatch span shows it)."""
        if self.policy == "round_robin":
            return "round_robin: next in turn"
        s = self.worker_stats.get(w.name)
        load = f"{w.active} active + {s.queue_depth if s else 0} queued, {s.blocks_free if s else '?'} blocks free"
        if self.policy == "prefix":
            return f"prefix: {self.matched_blocks(w, hashes)} cached blocks matched; {load}"
        return f"least_loaded: {load}"

    async def sync(self, workers: list[WorkerHandle]) -> None:
        """Drain these workers' cache events into the index (a failed call is retried next poll)."""

        async def one(w: WorkerHandle) -> None:
            async with self._sync_locks.setdefault(w.name, asyncio.Lock()):
                r = await w.cache_events()
                self.prefix_index.apply(w.name, r)

        await asyncio.gather(*(one(w) for w in workers if w.alive), return_exceptions=True)

    def forget(self, w: WorkerHandle) -> None:
        """A dead worker's cache died with it."""
        self.prefix_index.forget(w.name)
