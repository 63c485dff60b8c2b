"""Keep the garbage collector's full pauses out of a timed run, and record the pauses it still has.

`bench compare` runs the client and the pdserve router in one process (`ServerThread`), and by its
last mode that process holds enough objects (Ray, the earlier modes' results, the simulator) that a
full (generation 2) collection stopped every thread of it for 0.35-0.54 s (measured at 21:40 UTC
on the 2-core VM, from `gc.callbacks`). One landing at the start of a timed run delays every
request that was just sent by that much, at the client and the router alike, whatever the mode.

`QuietGC` collects once before the run and freezes what survives (`gc.freeze`, the permanent
generation), so a collection during the run scans only what the run itself allocated; after the
run the objects are unfrozen. It records every collection during the run (generation, pause).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class QuietGC:
    pauses: list[tuple[int, float]] = field(default_factory=list)  # (generation, seconds)
    frozen: int = 0  # objects moved to the permanent generation before the run
    _t0: float = 0.0

    def __enter__(self) -> QuietGC:
        gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)
        gc.unfreeze()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((int(info["generation"]), time.perf_counter() - self._t0))

    def summary(self) -> dict[str, Any]:
        full = [s for g, s in self.pauses if g == 2]
        return {
            "frozen_objects": self.frozen,
            "collections": len(self.pauses),
            "full_collections": len(full),
            "max_pause_ms": round(max((s for _, s in self.pauses), default=0.0) * 1e3, 3),
            "total_pause_ms": round(sum(s for _, s in self.pauses) * 1e3, 3),
        }
