"""Content hashes of full KV blocks, chained over (parent hash, block token ids).

A block's hash names the whole prefix up to its end, so two sequences share block i only if
their first (i + 1) * block_size tokens are equal. The hash is stable across processes and
machines (blake2b, not Python's salted `hash`): the router computes the same hashes from a
request's token ids to find which worker holds its prefix. Pure Python, no torch: the router
imports it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = 0  # the parent hash of a sequence's first block


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """64-bit chained hash of one full block."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT, start: int = 0) -> list[int]:
    """Hashes of the full blocks of `token_ids`, from block `start` on (`parent` is the hash of
    block start - 1, or ROOT)."""
    out = []
    for i in range(start, len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
