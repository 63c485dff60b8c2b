"""`bench gpu` ceilings: device-to-device copy bandwidth and `_scaled_mm` FP8 TFLOP/s at the
model's GEMM shapes for M = 16 .. 16k (the two roofs the other sections are measured against)."""

from __future__ import annotations

import time

import torch

from benchmarks.gpu.timing import cuda_time
from engine.torch_compat import scaled_mm


def gemm_shapes(cfg) -> dict[str, tuple[int, int]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (h, cfg.q_size + 2 * cfg.kv_size), "o": (cfg.q_size, h), "gate_up": (h, 2 * i), "down": (i, h)}


def bench_ceilings(cfgs, cap_s: float) -> dict:
    from engine.kv.cache import FP8  # noqa: PLC0415

    end = time.perf_counter() + cap_s
    n = 2 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    t = cuda_time(lambda: dst.copy_(src), reps=10)  # noqa: F821 - ruff misreads the later `del`
    copy = {"bytes": n, "seconds": t, "copy_GBps_read_plus_write": 2 * n / t / 1e9, "copy_GBps_one_way": n / t / 1e9}
    del src, dst
    rows = []
    for cfg in cfgs:
        for name, (K, N) in gemm_shapes(cfg).items():
            w = torch.randn(N, K, device="cuda").to(FP8)
            sw = torch.rand(1, N, device="cuda") + 0.5
            for M in (16, 64, 256, 1024, 4096, 16384):
                if time.perf_counter() > end:
                    break
                x = torch.randn(M, K, device="cuda").to(FP8)
                sx = torch.rand(M, 1, device="cuda") + 0.5
                fn = lambda: scaled_mm(x, w.t(), sx, sw, torch.bfloat16)  # noqa: E731
                s = cuda_time(fn, reps=5, inner=max(1, 4096 // M))
                rows.append(
                    {
                        "model": cfg.name,
                        "gemm": name,
                        "M": M,
                        "K": K,
                        "N": N,
                        "seconds": s,
                        "TFLOPs": 2 * M * N * K / s / 1e12,
                    }
                )
    return {"copy": copy, "scaled_mm": rows, "fp8_peak_TFLOPs": max((r["TFLOPs"] for r in rows), default=None)}
