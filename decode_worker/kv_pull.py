"""A prompt's KV pulled whole from the prefill worker that holds it, within that worker's lease.

The prefill side frees the prompt's blocks at its lease deadline and may reuse them at once, so
a pull is only valid if it finishes before then (the same clock on one node; NTP across nodes).
`pull_within_lease` refuses to start a pull that is already late, turns a timeout that the lease
(not `--transfer-timeout-s`) cut short into `LeaseExpired`, throws away a pull that finished
after the deadline, and otherwise tells the prefill side it may free its copy. It runs on the
decode worker's transfer thread (decode_worker/worker.py), so running streams keep decoding.
"""

from __future__ import annotations

import time

from transport.base import TransferTimeout, Transport, TransportError
from transport.wire import KVHandle, TransferStats


class LeaseExpired(TransportError):
    """The prefill side's lease on the KV ran out before the pull finished: its blocks may
    already hold another prompt, so the copy cannot be trusted."""


def pull_within_lease(
    transport: Transport, request_id: str, handle: KVHandle, blocks: list[int], timeout_s: float
) -> TransferStats:
    """Read `handle`'s blocks into the local `blocks` (one for one), then notify the holder.
    A handle with no blocks (every one was in the local prefix cache) crosses nothing. Raises
    `LeaseExpired` or the transport's error; the stats carry the pull's wall-clock span."""
    left = handle.lease_deadline - time.time()
    if left <= 0:
        raise LeaseExpired(
            f"the KV lease on {handle.agent} expired {-left:.2f} s before the pull started; raise --lease-s"
        )
    transport.connect(handle.source)
    started = time.time()
    try:
        if handle.block_ids:
            stats = transport.read(handle, blocks, min(timeout_s, left))
        else:  # every block was in the local cache: nothing crosses the wire
            stats = TransferStats.build(request_id, transport.backend, 0, 0, 0.0)
    except TransferTimeout:
        if left >= timeout_s:
            raise
        raise LeaseExpired(
            f"the KV lease on {handle.agent} ran out ({left:.2f} s left when the "
            "pull started) before the pull finished; raise --lease-s"
        ) from None
    late = time.time() - handle.lease_deadline
    if late >= 0:
        raise LeaseExpired(
            f"the pull from {handle.agent} finished {late:.2f} s after the KV lease "
            "ran out, so its blocks may hold another prompt; raise --lease-s"
        )
    transport.notify(handle.agent, request_id)
    stats.start_unix, stats.end_unix = started, time.time()
    return stats
