"""Timing helpers shared by the `bench gpu` sections: CUDA-event medians and percentiles."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

CTX = 4096  # decode context (tokens per sequence) used by every section


def cuda_time(fn: Callable[[], Any], reps: int = 10, warmup: int = 3, inner: int = 1) -> float:
    """Median seconds per call over `reps` samples of `inner` calls each (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(samples)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
