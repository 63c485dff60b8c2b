"""Give the heap's free pages back to the OS when a worker's engine loop runs out of work.

A prefill step's activations follow its prompts' lengths. glibc's dynamic mmap threshold soon
moves such buffers from mmap into the loop thread's malloc arena, where prompts of ever new
lengths leave free holes the arena keeps: served varied prompt lengths, a prefill worker's RSS
swung by 10-20 MB from one idle moment to the next with nothing more in use (glibc's mallinfo2,
issue 40). `malloc_trim(0)` returns every arena's free pages; run when the loop goes idle, at most
once every `min_interval_s`, it delays no step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable


def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """`worked()` after each step; `idle()` when the loop has nothing to do: trims if a step ran
    since the last trim and `min_interval_s` has passed. `trims` and `seconds` count its work."""

    def __init__(self, min_interval_s: float = 1.0, enabled: bool = True):
        self._trim = _libc_malloc_trim() if enabled else None
        self.min_interval_s = min_interval_s
        self._last = -min_interval_s
        self._dirty = False
        self.trims = 0
        self.seconds = 0.0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def worked(self) -> None:
        self._dirty = True

    def idle(self) -> None:
        if self._trim is None or not self._dirty:
            return
        now = time.monotonic()
        if now - self._last < self.min_interval_s:
            return
        self._trim(0)
        done = time.monotonic()
        self._last, self._dirty = done, False
        self.trims += 1
        self.seconds += done - now
