"""The requests a decode worker was told to abort, remembered for a while.

The router's abort and submit calls run on separate threads, so a submit can reach the worker
after its own abort; remembered, it is refused instead of decoded for nobody, and a KV pull that
lands after its abort is discarded.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Container

# How long an abort is remembered: longer than any transfer, so an aborted pull is always discarded.
ABORT_MEMORY_S = 120.0


class AbortMemory:
    """Aborted request ids, oldest first. Loop thread only."""

    def __init__(self) -> None:
        self._when: OrderedDict[str, float] = OrderedDict()  # request id -> when aborted (wall clock)

    def add(self, request_id: str) -> None:
        self._when[request_id] = time.time()
        self._when.move_to_end(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._when

    def forget_old(self, in_transfer: Container[str]) -> None:
        """Forget aborts older than ABORT_MEMORY_S, oldest first, stopping at the first one that
        is recent or whose pull still runs (its result must still be discarded when it lands)."""
        cutoff = time.time() - ABORT_MEMORY_S
        while self._when:
            rid, t = next(iter(self._when.items()))
            if t > cutoff or rid in in_transfer:
                return
            del self._when[rid]
