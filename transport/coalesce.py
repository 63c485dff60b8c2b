"""Turn a block-id mapping into as few byte ranges as possible.

A transfer moves remote block r[i] into local block l[i]. In the block-major pool (see
engine/kv/layout.py) a block is one contiguous byte range, so wherever both r and l step by +1
the blocks merge into one range. A fresh block manager hands out ascending ids, so a long prompt
usually becomes one descriptor instead of thousands: descriptor count, not bytes, is what makes
naive KV transfers crawl (each descriptor costs a post, a completion and, over RDMA, a work
request).

`coalesce(..., enabled=False)` keeps one range per block: the benchmark's "coalescing off" arm.
`split_for_streams` then cuts the ranges into byte-balanced groups, one per parallel stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    """`nbytes` bytes at `remote_offset` in the peer's pool go to `local_offset` in ours."""

    remote_offset: int
    local_offset: int
    nbytes: int


def check_blocks(
    remote_blocks: Sequence[int], local_blocks: Sequence[int], remote_num_blocks: int, local_num_blocks: int
) -> None:
    """Raise ValueError for mappings that would read or write outside a pool or clobber a block."""
    if len(remote_blocks) != len(local_blocks):
        raise ValueError(f"{len(remote_blocks)} remote blocks but {len(local_blocks)} local blocks")
    for name, ids, n in (("remote", remote_blocks, remote_num_blocks), ("local", local_blocks, local_num_blocks)):
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            raise ValueError(f"{name} block ids {bad[:5]} outside the pool of {n} blocks")
    if len(set(local_blocks)) != len(local_blocks):
        raise ValueError("local block ids repeat: two remote blocks would land in one local block")


def coalesce(
    remote_blocks: Sequence[int],
    local_blocks: Sequence[int],
    block_bytes: int,
    enabled: bool = True,
    ranges: Sequence[tuple[int, int]] | None = None,
) -> list[Run]:
    """Byte ranges for moving remote_blocks[i] -> local_blocks[i], merged where both sides are
    consecutive (and in order). Order of the result follows the input.

    `ranges`: only these (offset, length) ranges of each block (a group of layers:
    KVLayout.layer_ranges); default the whole block. A slice of one block never touches the
    same slice of the next, so a group's runs are two per block (data, scales) unless the group
    is every layer, when the whole-block merging above applies again."""
    parts = list(ranges) if ranges is not None else [(0, block_bytes)]
    runs: list[Run] = []
    for r, l in zip(remote_blocks, local_blocks):  # noqa: E741 - r/l: remote/local
        for off, n in parts:
            ro, lo = r * block_bytes + off, l * block_bytes + off
            last = runs[-1] if runs else None
            if enabled and last and last.remote_offset + last.nbytes == ro and last.local_offset + last.nbytes == lo:
                runs[-1] = Run(last.remote_offset, last.local_offset, last.nbytes + n)
            else:
                runs.append(Run(ro, lo, n))
    return runs


def split_for_streams(runs: list[Run], streams: int, min_bytes: int = 1 << 20) -> list[list[Run]]:
    """Byte-balanced groups of runs, at most `streams` of them, cutting a run in two where a group
    boundary falls inside it. Groups smaller than `min_bytes` are not worth a thread, so small
    transfers stay one group."""
    total = sum(r.nbytes for r in runs)
    streams = max(1, min(streams, total // max(min_bytes, 1) or 1))
    if streams == 1:
        return [list(runs)]
    target = -(-total // streams)
    groups: list[list[Run]] = [[]]
    room = target
    for run in runs:
        ro, lo, n = run.remote_offset, run.local_offset, run.nbytes
        while n > 0:
            if room == 0:
                groups.append([])
                room = target
            take = min(n, room)
            groups[-1].append(Run(ro, lo, take))
            ro, lo, n, room = ro + take, lo + take, n - take, room - take
    return groups
