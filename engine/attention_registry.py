"""Which attention backend a device gets.

Kept apart from engine/attention.py (the base class and the reference) so that the GPU backend,
which subclasses the base, and the choice between backends do not import each other.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, TorchReferenceAttention


def default_backend(device: torch.device) -> AttentionBackend:
    """The fastest backend available on `device` (the torch reference on CPU)."""
    if device.type == "cuda":
        try:
            from engine.gpu.attention import CudaAttention  # noqa: PLC0415 (optional: needs triton)

            return CudaAttention()
        except ImportError:
            pass
    return TorchReferenceAttention()
