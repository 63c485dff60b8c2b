"""`bench gpu` transfer section: the 671 MB KV transfer between two processes on the card, against
the copy ceiling (NIXL when importable, else CUDA IPC through torch.multiprocessing)."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu.timing import cuda_time

KV_TRANSFER_BYTES = 4096 * 80 * 2 * 8 * 128  # the article's 671 MB: 4k tokens of 70B FP8 K/V


def _ipc_producer(q, release, nbytes: int) -> None:
    """Child process: owns the source buffer; the parent maps it through CUDA IPC."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    torch.cuda.synchronize()
    q.put(src)
    release.get()


def bench_transfer(copy_one_way: float | None, cap_s: float) -> dict:
    out: dict[str, Any] = {"bytes": KV_TRANSFER_BYTES}
    try:
        import nixl  # noqa: F401,PLC0415

        from transport import nixl_backend  # noqa: F401,PLC0415

        out["nixl"] = "importable, but the device-memory NIXL run is not wired into this script yet"
    except ImportError as e:
        out["nixl"] = f"skipped: {e} (nixl is not on the device image; carry nixl-cu13 wheels to measure it)"
    ctx = torch.multiprocessing.get_context("spawn")
    q, release = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_producer, args=(q, release, KV_TRANSFER_BYTES), daemon=True)
    p.start()
    try:
        remote = q.get(timeout=cap_s)  # a tensor in the child's memory, opened via cudaIpcOpenMemHandle
        local = torch.empty_like(remote)
        t = cuda_time(lambda: local.copy_(remote), reps=10, warmup=2)  # noqa: F821 - ruff misreads the later `del`
        ok = bool(torch.equal(local, remote))
        out["cuda_ipc"] = {
            "seconds": t,
            "GBps": KV_TRANSFER_BYTES / t / 1e9,
            "verified": ok,
            "copy_fraction": (KV_TRANSFER_BYTES / t / 1e9) / copy_one_way if copy_one_way else None,
            "how": "torch.multiprocessing CUDA IPC handle, device-to-device copy from a second process",
        }
        del remote
    finally:
        release.put(1)
        p.join(30)
    return out
