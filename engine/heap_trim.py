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


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (2.33+): every field a size_t, summed over all arenas
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def _libc_mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.argtypes = []
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _libc_mallinfo2()


def heap_usage() -> tuple[int, int]:
    """(bytes malloc has handed out and not had back, free bytes its arenas keep) in this process,
    from glibc's mallinfo2; (0, 0) where the C library has none. RSS alone cannot tell a leak (in
    use grows) from fragmentation (free kept grows) or from memory malloc never saw (neither grows:
    torch's and NIXL's own mmaps, thread stacks)."""
    if _MALLINFO2 is None:
        return 0, 0
    m = _MALLINFO2()
    return int(m.uordblks + m.hblkhd), int(m.fordblks)


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
