"""Which attention backend a device gets.

Kept apart from engine/model/attention.py (the base class and the reference) so that the GPU backend,
which subclasses the base, and the choice between backends do not import each other.
"""

from __future__ import annotations

import torch

from engine.model.attention import AttentionBackend, TorchReferenceAttention
from engine.model.cpu_attention import BatchedAttention

# `--attention` choices: "auto" is the fastest for the device; "reference" the per-sequence oracle
BACKENDS = ("auto", "batched", "reference", "cuda")


def default_backend(device: torch.device) -> AttentionBackend:
    """The fastest backend available on `device` (the batched torch backend on CPU)."""
    if device.type == "cuda":
        try:
            from engine.gpu.attention import CudaAttention  # noqa: PLC0415 (optional: needs triton)

            return CudaAttention()
        except ImportError:
            pass
    return BatchedAttention()


def backend_by_name(name: str, device: torch.device) -> AttentionBackend:
    """One of BACKENDS (benchmarks compare them in one run)."""
    if name == "auto":
        return default_backend(device)
    if name == "batched":
        return BatchedAttention()
    if name == "reference":
        return TorchReferenceAttention()
    if name == "cuda":
        from engine.gpu.attention import CudaAttention  # noqa: PLC0415 (optional: needs triton)

        return CudaAttention()
    raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(BACKENDS)})")
