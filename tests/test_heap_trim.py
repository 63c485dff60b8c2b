"""HeapTrimmer (engine/heap_trim.py): free heap pages go back to the OS when a worker idles."""

from __future__ import annotations

import time

import pytest

from engine.heap_trim import HeapTrimmer


def test_trims_once_after_work_and_not_more_often_than_its_interval():
    heap = HeapTrimmer(min_interval_s=0.2)
    if not heap.available:
        pytest.skip("this C library has no malloc_trim")
    heap.idle()
    assert heap.trims == 0  # no step ran: nothing to give back
    heap.worked()
    heap.idle()
    assert heap.trims == 1
    heap.worked()
    heap.idle()
    assert heap.trims == 1  # within the interval: waits
    time.sleep(0.25)
    heap.idle()
    assert heap.trims == 2 and heap.seconds > 0
    heap.idle()
    assert heap.trims == 2  # idle again with no work since


def test_off_means_never():
    heap = HeapTrimmer(enabled=False)
    heap.worked()
    heap.idle()
    assert heap.trims == 0 and not heap.available
