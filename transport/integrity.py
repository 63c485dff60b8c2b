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


def block_checksums(
    pool: torch.Tensor, block_ids: Sequence[int], ranges: Sequence[tuple[int, int]] | None = None
) -> tuple[int, ...]:
    """One checksum per block of `pool` ([num_blocks, block_bytes] uint8), in `block_ids` order.
    `ranges`: only these (offset, length) byte ranges of each block, summed together (a group of
    layers under layer-wise streaming, KVLayout.layer_ranges); default the whole block."""
    import torch  # noqa: PLC0415 - the wire types that import this module stay torch-free

    if not block_ids:
        return ()
    parts = list(ranges) if ranges is not None else [(0, pool.shape[1])]
    sizes = [x for part in parts for x in part]
    word = torch.int64 if all(x % 8 == 0 for x in sizes) else torch.int32 if all(x % 4 == 0 for x in sizes) else None
    sums: list[torch.Tensor] = []
    for first, n in _runs(block_ids):
        slices = [pool[first : first + n, off : off + length] for off, length in parts]
        words = [x.view(word) if word is not None else x for x in slices]
        sums.append(sum(w.sum(dim=1, dtype=torch.int64) for w in words[1:]) + words[0].sum(dim=1, dtype=torch.int64))
    return tuple(int(x) for x in torch.cat(sums).tolist())  # one device->host copy


def mismatched_blocks(
    pool: torch.Tensor,
    local_blocks: Sequence[int],
    expected: Sequence[int],
    ranges: Sequence[tuple[int, int]] | None = None,
) -> list[int]:
    """Positions i whose block local_blocks[i] (or its `ranges`) does not sum to expected[i]
    (all of them if the counts differ)."""
    if len(expected) != len(local_blocks):
        return list(range(len(local_blocks)))
    return [i for i, (g, e) in enumerate(zip(block_checksums(pool, local_blocks, ranges), expected)) if g != e]
