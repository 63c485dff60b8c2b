"""BlockManager: owns the free list and reference counts of the paged KV pool.

Invariants (checked by tests/test_block_manager.py under random workloads):
- a block is either free (ref count 0, on the free list exactly once) or owned (ref count >= 1);
- `num_free + num_used == num_blocks` at all times;
- freeing a block that is not owned is an error, never a silent double free.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; callers queue the request and retry later."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, each with ref count 1. Lowest ids first, so a fresh pool hands out
        contiguous runs (which the transport coalesces into few descriptors)."""
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
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
        """Drop one reference from each block; blocks reaching zero return to the free list."""
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"double free of KV block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]
