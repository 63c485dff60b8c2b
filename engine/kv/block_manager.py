"""BlockManager: the paged KV pool's ledger, with automatic prefix caching.

Every block is always in exactly one of three states:

- free:    ref count 0, no content worth keeping; on the free list exactly once;
- cached:  ref count 0, holds a full block whose content hash is registered; kept for reuse and
           evicted least recently used first when fresh blocks are needed;
- in use:  ref count >= 1 (sequences, parked prefills or pulls in flight hold it). An in-use block
           may also carry a hash (a shared prefix block).

`allocate` hands out free blocks first, then evicts cached ones, so `num_free` (what can be
allocated) counts both. A full block's hash is chained over (parent hash, its token ids)
(engine/kv/prefix_cache.py), so equal hashes mean equal prefixes, and a sequence reuses the longest
run of cached blocks that starts its tokens. Cache events (a hash stored, a hash evicted) are
recorded for the router's prefix index.

Invariants (checked by `check()`, which tests call after every kind of failure):
free + cached + in use == num_blocks; no block in two states; a hash maps to exactly one block
and that block carries it; freeing a block that is not in use is an error, never a silent
double free.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; callers queue the request and retry later."""


@dataclass(frozen=True)
class Ledger:
    free: int
    cached: int
    in_use: int


class BlockManager:
    # cache events kept for a reader (the worker drains them); beyond this the oldest are dropped
    # and the reader is told to resynchronise from a snapshot. None are kept until a reader first
    # drains: the router reads them only under a prefix-aware policy, and a worker nobody reads
    # held 65,536 of them (~6 MB of Python objects a worker, issue 40's memory creep).
    MAX_EVENTS = 65536

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}  # hash -> block
        self.events: deque[tuple[bool, int]] = deque()  # (stored?, hash): True stored, False evicted
        self.events_dropped = False
        self._events_read = False  # has a reader drained the events yet? (until then none are kept)
        self.hits = 0  # prefix-cache lookups: blocks found
        self.lookups = 0  # prefix-cache lookups: blocks asked for
        self.evictions = 0

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free plus cached (evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ledger(self) -> Ledger:
        return Ledger(len(self._free), len(self._cached), self.num_used)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks, each with ref count 1: free ones first (lowest ids first, so a fresh pool
        hands out contiguous runs the transport coalesces), then the least recently used cached."""
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._cached.popitem(last=False)
                self._evict(b)
            self._refs[b] = 1
            out.append(b)
        return out

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend `block_table` in place so it can hold `num_tokens` tokens."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need > 0:
            block_table.extend(self.allocate(need))

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"incref of free block {b}")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block. A block reaching zero becomes cached if it holds a
        registered hash, else free. Cached blocks join the LRU last first, so a sequence's tail (the
        part least likely to be shared) is evicted before its head."""
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"double free of KV block {b}")
        newly_cached = []
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._hash_of[b] is not None:
                    newly_cached.append(b)
                else:
                    self._free.append(b)  # in order: contiguous runs stay contiguous
        for b in reversed(newly_cached):
            self._cached[b] = None

    # ---- prefix cache ------------------------------------------------------------------------
    def match(self, hashes: list[int]) -> list[int]:
        """The blocks holding the longest cached run of `hashes` (full blocks in token order).
        Takes no references: `acquire` them before the next allocation can evict them."""
        out: list[int] = []
        if self.enable_caching:
            for h in hashes:
                b = self._block_of.get(h)
                if b is None:
                    break
                out.append(b)
        self.lookups += len(hashes)
        self.hits += len(out)
        return out

    def evictable(self, blocks: list[int]) -> int:
        """How many of `blocks` are cached (ref count 0): acquiring them lowers `num_free`."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on matched blocks (cached ones move to in use)."""
        for b in blocks:
            if self._refs[b] == 0:
                if b not in self._cached:
                    raise ValueError(f"acquire of block {b}, which is free, not cached")
                del self._cached[b]
            self._refs[b] += 1

    def commit(self, block: int, block_hash: int) -> None:
        """`block` (in use) now holds the full block whose chained hash is `block_hash`. The first
        block to hold a hash is the one reused; a later duplicate stays unregistered (freed as
        plain free when its holders let go)."""
        if not self.enable_caching or block_hash in self._block_of or self._hash_of[block] is not None:
            return
        if self._refs[block] < 1:
            raise ValueError(f"commit of block {block}, which is not in use")
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        self._record(True, block_hash)

    def cached_hashes(self) -> list[int]:
        """Every registered hash (cached or in use): a snapshot for a reader that lost events."""
        return list(self._block_of)

    def drain_events(self) -> tuple[list[tuple[bool, int]], bool]:
        """(events since the last drain, whether some were dropped: then resync from a snapshot).
        The first drain starts the recording: it reports dropped if any hash was registered before."""
        self._events_read = True
        out, dropped = list(self.events), self.events_dropped
        self.events.clear()
        self.events_dropped = False
        return out, dropped

    def _evict(self, b: int) -> None:
        h = self._hash_of[b]
        assert h is not None  # only hashed blocks are ever cached
        self._hash_of[b] = None
        del self._block_of[h]
        self.evictions += 1
        self._record(False, h)

    def _record(self, stored: bool, h: int) -> None:
        if not self._events_read:  # nobody reads them (yet): the first reader takes a snapshot
            self.events_dropped = True
            return
        if len(self.events) >= self.MAX_EVENTS:
            self.events.popleft()
            self.events_dropped = True
        self.events.append((stored, h))

    # ---- the ledger's invariants ------------------------------------------------------------
    def check(self) -> Ledger:
        """Assert every invariant of the module docstring; returns the ledger."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & cached, "a block is both free and cached"
        for b in range(self.num_blocks):
            states = (b in free) + (b in cached) + (self._refs[b] > 0)
            assert states == 1, f"block {b} is in {states} states (ref count {self._refs[b]})"
            assert self._refs[b] >= 0
            if b in free:
                assert self._hash_of[b] is None, f"free block {b} carries a hash"
            if b in cached:
                assert self._hash_of[b] is not None, f"cached block {b} has no hash"
        for h, b in self._block_of.items():
            assert self._hash_of[b] == h, f"hash index points at block {b}, which holds another hash"
        assert sum(h is not None for h in self._hash_of) == len(self._block_of)
        ledger = self.ledger()
        assert ledger.free + ledger.cached + ledger.in_use == self.num_blocks
        return ledger
