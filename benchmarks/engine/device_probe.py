"""What this machine's device can do, measured in the run that uses the figures.

- `copy_bandwidth`: a large tensor copy's (read + write) bytes per second (`bench step`'s floor).
- `probe_device`: the device's achievable memory bandwidth (a large tensor copy) and dense
  GEMM FLOP/s, measured in the same run. On a CPU there is no datasheet, so these two numbers
  are the "device spec" the cost model is evaluated against.
- `cpu_name`, `mem_bytes`, `load_average`: what the result records say about the machine, and
  how contended it was while the timings were taken.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.engine.timing import measure
from engine.torch_compat import scaled_mm


@dataclass(frozen=True)
class DeviceProbe:
    """What this run measured about the device itself."""

    device: str
    copy_gbps: float  # (bytes read + bytes written) / s of a large tensor copy, GB/s (1e9)
    copy_bytes: int  # size of the copied tensor
    gemm_tflops: float  # dense GEMM, TFLOP/s (1e12)
    gemm_dtype: str  # dtype of that GEMM ("fp32" on CPU, "bf16"/"fp8" on CUDA)
    gemm_shape: int  # n of the n x n x n GEMM

    def describe(self) -> str:
        return (
            f"measured in this run on {self.device}: {self.copy_gbps:.1f} GB/s tensor copy "
            f"({self.copy_bytes / 2**20:.0f} MiB, read+write), {self.gemm_tflops * 1e3:.1f} GFLOP/s "
            f"{self.gemm_dtype} GEMM (n={self.gemm_shape})"
        )


def _gemm_fn(n: int, dtype: str, device: torch.device) -> Callable[[], Any]:
    if dtype == "fp8":
        fp8 = torch.float8_e4m3fn
        a = torch.randn(n, n, device=device).to(fp8)
        b = torch.randn(n, n, device=device).to(fp8).t()  # _scaled_mm wants column-major B
        one = torch.ones((), device=device)
        return lambda: scaled_mm(a, b, one, one, torch.bfloat16)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    return lambda: a @ b


def copy_bandwidth(device: torch.device, mib: int | None = None, repeats: int = 5) -> tuple[float, int]:
    """(bytes read + bytes written) per second of a large tensor copy, and the bytes copied: the
    memory traffic rate a memory-bound step can hope for. 256 MiB on a CPU (8x a server L3),
    4 GiB on a GPU."""
    mib = mib or (4096 if device.type == "cuda" else 256)
    n_elem = mib * 2**20 // 4
    src = torch.rand(n_elem, device=device)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), device, repeats, warmup=2).median_s  # noqa: F821 - ruff misreads the later `del`
    del src, dst
    return 2 * n_elem * 4 / t, n_elem * 4


def probe_device(
    device: torch.device,
    gemm_dtype: str | None = None,
    copy_mib: int | None = None,
    gemm_n: int | None = None,
    repeats: int = 5,
) -> DeviceProbe:
    """Measure copy bandwidth and GEMM FLOP/s. Sizes default to what saturates the device
    without taking long: 256 MiB / n=2048 on a CPU, 4 GiB / n=8192 on a GPU."""
    cuda = device.type == "cuda"
    gemm_n = gemm_n or (8192 if cuda else 2048)
    gemm_dtype = gemm_dtype or ("bf16" if cuda else "fp32")
    copy_bps, copy_bytes = copy_bandwidth(device, copy_mib, repeats)
    try:
        fn = _gemm_fn(gemm_n, gemm_dtype, device)
        t_gemm = measure(fn, device, repeats, warmup=2).median_s
    except (RuntimeError, TypeError):  # e.g. no FP8 GEMM on this GPU: fall back to bf16
        gemm_dtype = "bf16"
        t_gemm = measure(_gemm_fn(gemm_n, "bf16", device), device, repeats, warmup=2).median_s
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return DeviceProbe(
        device=name,
        copy_gbps=copy_bps / 1e9,
        copy_bytes=copy_bytes,
        gemm_tflops=2 * gemm_n**3 / t_gemm / 1e12,
        gemm_dtype=gemm_dtype,
        gemm_shape=gemm_n,
    )


def load_average() -> list[float] | None:
    """1/5/15-minute load average: on a shared machine it says how much the timings were contended."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def mem_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 0.0
