"""Timers shared by the engine benchmarks (`bench chunks`, `bench article`, `bench step`).

- `time_call`: one call, timed the way a caller sees it. On CUDA with events recorded around
  the call and a synchronize after it; on CPU with perf_counter. The engine's forward ends with
  a host copy of the logits, so both include the host-side step preparation a real step pays.
- `measure`: warm-up, then repeats, summarised by the median (robust to a noisy neighbour).

What the device itself can do is measured in `benchmarks/engine/device_probe.py`, with these timers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of `fn` takes on `device`."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    max_s: float
    repeats: int

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))


def measure(fn: Callable[[], Any], device: torch.device, repeats: int = 5, warmup: int = 1) -> Timing:
    for _ in range(warmup):
        fn()
    sync(device)
    return Timing.of([time_call(fn, device) for _ in range(max(1, repeats))])
