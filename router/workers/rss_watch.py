"""RssWatch: warns when a worker's resident memory keeps growing after warm-up.

A worker's RSS rises while it warms up (weights dequantized and packed on first use, kernels
built for the shapes it meets, the allocator's first high-water marks) and should then stay
flat: the KV pool is allocated once. Growth past that is what ran workers out of RAM in issue
22 (per-shape oneDNN primitives, one set per prompt length). The watch takes each worker's
baseline at its first report after `warmup_steps` engine steps and logs a warning each time the
growth over that baseline crosses another multiple of `bound_bytes`, so a slow leak is reported
as it goes on, not once per health tick. A replaced worker has a new name, hence a new baseline.

It is fed every WorkerStats the router reads (the stats refresh, a /metrics scrape, and the
health loop's periodic read), and is pure logic: tests drive it with hand-made WorkerStats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from contracts.worker import WorkerStats

log = logging.getLogger("pdserve.router")
RSS_WARMUP_STEPS = 200  # engine steps a worker runs before its RSS baseline is taken
RSS_CHECK_S = 10.0  # the health loop reads every worker's stats at least this often for the watch


@dataclass
class _Track:
    baseline: int  # bytes, at the first report after warm-up
    steps: int  # the worker's step count then
    warned: int = 0  # multiples of the bound already reported


class RssWatch:
    def __init__(self, bound_mb: float, warmup_steps: int = RSS_WARMUP_STEPS):
        if bound_mb <= 0:
            raise ValueError("the RSS growth bound must be > 0 MB (leave the watch out to turn it off)")
        if warmup_steps < 0:
            raise ValueError("warm-up steps must be >= 0")
        self.bound_bytes = int(bound_mb * 1024**2)
        self.warmup_steps = warmup_steps
        self._tracks: dict[str, _Track] = {}

    def observe(self, stats: list[WorkerStats]) -> list[str]:
        """Take baselines and check growth; returns the warnings logged (one line each)."""
        out = []
        for w in stats:
            if w.rss_bytes <= 0 or w.steps < self.warmup_steps:
                continue  # not measurable here, or still warming up
            t = self._tracks.get(w.name)
            if t is None:
                self._tracks[w.name] = _Track(w.rss_bytes, w.steps)
                continue
            crossed = (w.rss_bytes - t.baseline) // self.bound_bytes
            if crossed > t.warned:
                t.warned = int(crossed)
                msg = (
                    f"{w.role} worker {w.name}: RSS {w.rss_bytes / 1024**2:.0f} MB, grown "
                    f"{(w.rss_bytes - t.baseline) / 1024**2:.0f} MB since warm-up "
                    f"({t.baseline / 1024**2:.0f} MB at step {t.steps}, now step {w.steps}); bound "
                    f"{self.bound_bytes / 1024**2:g} MB (--rss-growth-warn-mb). Memory that grows with "
                    "traffic runs a worker out of RAM: see docs/serving.md, 'Worker memory'"
                )
                log.warning("%s", msg)
                out.append(msg)
        return out

    def baseline(self, worker: str) -> int | None:
        """The worker's baseline RSS in bytes, once taken."""
        t = self._tracks.get(worker)
        return None if t is None else t.baseline
