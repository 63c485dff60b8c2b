"""KV integrity: a cheap checksum per block, computed where the KV lives, on both sides of a pull.

The holder (prefill) sums each of a handle's blocks once its KV is written and sends the sums in
the KVHandle; the puller (decode) sums the blocks it received and compares before any token is
decoded from them. A mismatch fails that request (transport.base.KVChecksumMismatch), never the worker.

The checksum of a block is the wrapping (mod 2**64) sum of its bytes read as 64-bit words (32-bit
where the block size is not a multiple of 8). It catches any change confined to one word (every
flipped bit, every torn or zeroed word), a range that landed in the wrong block (blocks differ), a
stale block (its previous occupant's sum), and almost every wider corruption; it does not see words
swapped inside one block, which no byte-range transport produces. It is one pass of reads with no
copy: runs of consecutive block ids are summed as slices of the pool, on the pool's device (a GPU
pool never leaves the GPU; only one int64 per block crosses to the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first id, count) for each run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def block_checksums(pool: torch.Tensor, block_ids: Sequence[int]) -> tuple[int, ...]:
    """One checksum per block of `pool` ([num_blocks, block_bytes] uint8), in `block_ids` order."""
    import torch  # noqa: PLC0415 - the wire types that import this module stay torch-free

    if not block_ids:
        return ()
    word = torch.int64 if pool.shape[1] % 8 == 0 else torch.int32
    sums = [pool[first : first + n].view(word).sum(dim=1, dtype=torch.int64) for first, n in _runs(block_ids)]
    return tuple(int(x) for x in torch.cat(sums).tolist())  # one device->host copy


def mismatched_blocks(pool: torch.Tensor, local_blocks: Sequence[int], expected: Sequence[int]) -> list[int]:
    """Positions i whose block local_blocks[i] does not sum to expected[i] (all of them if the
    counts differ)."""
    if len(expected) != len(local_blocks):
        return list(range(len(local_blocks)))
    return [i for i, (g, e) in enumerate(zip(block_checksums(pool, local_blocks), expected)) if g != e]
