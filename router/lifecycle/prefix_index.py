"""PrefixIndex: which worker holds which cached KV blocks, as the router knows it.

Kept up to date from the workers' cache events (a chained block hash stored or evicted; see
engine/kv/prefix_cache.py), polled by the orchestrator. Because a block's hash names its whole
prefix, the blocks a worker holds for a request are the longest run of the request's block
hashes found in that worker's set. The index may lag the workers by one poll: a stale hit only
costs a recompute on the worker, never a wrong token (the worker matches its own cache).
"""

from __future__ import annotations

from contracts.worker import CacheEvents


class PrefixIndex:
    def __init__(self) -> None:
        self._held: dict[str, set[int]] = {}

    def apply(self, worker: str, update: CacheEvents) -> None:
        held = self._held.setdefault(worker, set())
        if update.snapshot is not None:  # events were lost: start again from the worker's word
            held.clear()
            held.update(update.snapshot)
            return
        for stored, h in update.events:
            if stored:
                held.add(h)
            else:
                held.discard(h)

    def forget(self, worker: str) -> None:
        """A dead worker's cache is gone with it."""
        self._held.pop(worker, None)

    def matched_blocks(self, worker: str, hashes: list[int]) -> int:
        """How many leading blocks of a request (its chained hashes) `worker` holds."""
        held = self._held.get(worker)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def size(self, worker: str) -> int:
        return len(self._held.get(worker, ()))
