"""A decode step's floors for `pdserve bench step`: plain PyTorch on the step's GEMM shapes, and
the bytes of weights a step reads over the measured copy bandwidth."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


@torch.inference_mode()
def torch_stack_ms(shapes: list[tuple[int, int]], rows: int, repeats: int = 3) -> float:
    """Plain PyTorch on the step's GEMM shapes: `F.linear` of `rows` fp32 rows through an fp32
    weight of every projection and the lm_head, no attention, no fusion (the median of `repeats`).
    What an eager model with no packing, no bf16 and no epilogues pays for its projections."""
    weights = [torch.randn(o, i) * 0.02 for o, i in shapes]
    xs = [torch.randn(rows, i) for _, i in shapes]
    times = []
    for _ in range(repeats + 1):  # the first pass warms the allocator and MKL
        t0 = time.perf_counter()
        for x, w in zip(xs, weights):
            torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def gemm_shapes(model: Any) -> list[tuple[int, int]]:
    """(out, in) of every projection a decode step multiplies by, and the lm_head."""
    from engine.model.linear import DenseLinear, Fp8Linear  # noqa: PLC0415

    lin = [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, (Fp8Linear, DenseLinear))]
    return lin + [(model.cfg.vocab_size, model.cfg.hidden_size)]


def weight_floor(step_ms: float, weight_bytes: int, copy_bps: float, copy_bytes: int) -> dict[str, Any]:
    """The decode step against the weight-read floor: weight bytes / measured copy bandwidth."""
    floor_ms = weight_bytes / copy_bps * 1e3
    return {
        "weight_bytes_per_step": weight_bytes,
        "copy_GBps": copy_bps / 1e9,
        "copy_bytes": copy_bytes,
        "floor_ms": floor_ms,
        "decode_step_over_floor": step_ms / floor_ms,
    }
