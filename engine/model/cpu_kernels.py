"""pdserve's own CPU kernels (engine/model/csrc/), built once per machine and loaded as torch ops.

Two kernels, both for a decode step (each source says why and what):
- `torch.ops.pdserve.paged_decode_fp8` (engine/model/csrc/paged_decode.cpp): the decode rows' attention
  over FP8 pages;
- `torch.ops.pdserve.fp8_linear` (engine/model/csrc/fp8_linear.cpp): a few rows times FP8 weights,
  reading the FP8 bytes instead of an fp32 copy (engine/model/linear.py uses it for decode steps).

They are built with torch's extension builder (g++ and ninja) on first use, into torch's
extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), for this machine's
instruction set (-march=native); later processes load the cached library in about a second, and
a changed source rebuilds. Several workers starting at once share one build (the builder locks
its directory). A process stopped mid-build leaves that lock behind, and the builder would wait
on it forever (a server killed in its first start hung every later start, 2026-12-06): a lock
older than BUILD_LOCK_STALE_S, a build's time several times over, is removed (`clear_stale_build_lock`).

Where they cannot be built (no compiler, no ninja, another CPU architecture's flags refused) or
`PDSERVE_CPU_KERNELS=0` is set, both ops are None and the torch paths run (batched attention,
oneDNN GEMMs over fp32 copies): the same arithmetic, slower. Why is in `unavailable_reason()`
and logged once.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("pdserve.engine")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_decode.cpp", CSRC / "fp8_linear.cpp"]  # and the header they share, cpu_math.h
ENV_SWITCH = "PDSERVE_CPU_KERNELS"  # "0" turns the kernels off (the torch path runs)
_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd"]
NAME = "pdserve_cpu_kernels"
BUILD_LOCK_STALE_S = 180.0  # the build takes ~30 s on the 2-core dev VM
_reason: str | None = None


@functools.cache
def _load() -> bool:
    """Build (or load the cached build of) the kernels; False, with the reason kept, on failure."""
    global _reason
    if os.environ.get(ENV_SWITCH, "1") == "0":
        _reason = f"turned off ({ENV_SWITCH}=0)"
        return False
    if hasattr(torch.ops, "pdserve") and hasattr(torch.ops.pdserve, "fp8_linear"):
        return True  # already registered in this process
    t0 = time.perf_counter()
    try:
        from torch.utils import cpp_extension  # noqa: PLC0415 (imports setuptools: only when needed)

        clear_stale_build_lock(Path(cpp_extension.get_default_build_root()))
        cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=_CFLAGS,
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 (any build failure means: run the torch path)
        _reason = f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("CPU kernels unavailable (%s); decode attention and GEMMs run in torch ops", _reason)
        return False
    log.info("CPU kernels ready in %.1f s (%s)", time.perf_counter() - t0, ", ".join(s.name for s in SOURCES))
    return True


def clear_stale_build_lock(root: Path) -> None:
    """Wait while another process builds (its lock younger than BUILD_LOCK_STALE_S); remove a lock
    older than that, which a process stopped mid-build left (the builder itself would wait forever)."""
    for lock in root.glob(f"*/{NAME}/lock"):
        while True:
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                break  # the build it guarded finished
            if age > BUILD_LOCK_STALE_S:
                log.warning("removing %s: a build lock %.0f s old, left by a process stopped mid-build", lock, age)
                lock.unlink(missing_ok=True)
                break
            time.sleep(1.0)


def paged_decode_op() -> Callable[..., torch.Tensor] | None:
    """`paged_decode_fp8(q, pages, scales, tables, lens, scale)`, or None where it is unavailable."""
    return torch.ops.pdserve.paged_decode_fp8 if _load() else None


def fp8_linear_op() -> Callable[..., torch.Tensor] | None:
    """`fp8_linear(x, w_bytes, scale, other, post)`, or None where it is unavailable."""
    return torch.ops.pdserve.fp8_linear if _load() else None


def unavailable_reason() -> str | None:
    """Why `paged_decode_op()` is None (None while it is available or not yet asked for)."""
    return _reason


if __name__ == "__main__":  # `python -m engine.model.cpu_kernels`: build now (make install does), say how it went
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = paged_decode_op() is not None
    print("CPU kernels:", "ready" if ok else f"unavailable ({unavailable_reason()}); the torch path will run")
    sys.exit(0)  # not an install failure: pdserve runs without it
