"""The auto dispatcher's own statistics (router/dispatch/dispatcher.py): how far its predictions fell from
what happened, and what its calls cost the router's event loop.

Both are reported in the dispatcher's summary (and from there in /metrics and the benchmarks'
reports); neither feeds back into a decision, so they live apart from the policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ERROR_BUCKETS = (0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0)  # |relative error| histogram bounds
WITHIN = 0.15


@dataclass
class ErrorHist:
    counts: list[int] = field(default_factory=lambda: [0] * (len(ERROR_BUCKETS) + 1))
    total: int = 0
    abs_sum: float = 0.0
    within: int = 0

    def observe(self, rel: float) -> None:
        a = abs(rel)
        i = next((k for k, b in enumerate(ERROR_BUCKETS) if a <= b), len(ERROR_BUCKETS))
        self.counts[i] += 1
        self.total += 1
        self.abs_sum += a
        self.within += a <= WITHIN

    def to_dict(self) -> dict[str, Any]:
        return {
            "buckets": list(ERROR_BUCKETS),
            "counts": self.counts,
            "count": self.total,
            "abs_sum": self.abs_sum,
            "within_15pct": self.within,
        }


@dataclass
class ReplayCost:
    """What the dispatcher's calls cost the router's event loop (they run on it, synchronously):
    replay iterations and wall time, per entry point."""

    calls: int = 0
    steps: int = 0
    max_steps: int = 0
    seconds: float = 0.0
    max_s: float = 0.0

    def observe(self, steps: int, seconds: float) -> None:
        self.calls += 1
        self.steps += steps
        self.max_steps = max(self.max_steps, steps)
        self.seconds += seconds
        self.max_s = max(self.max_s, seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "replay_steps": self.steps,
            "max_replay_steps": self.max_steps,
            "total_ms": round(self.seconds * 1e3, 3),
            "max_ms": round(self.max_s * 1e3, 3),
        }


def rel_error(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured; None when nothing finite was measured."""
    if not measured or not math.isfinite(measured):
        return None
    return round((predicted - measured) / measured, 4)
