"""benchmarks/client/gc_pauses.py: what exists before a timed run is frozen, and the run's collections are
recorded."""

import gc

from benchmarks.client.gc_pauses import QuietGC


def test_quiet_gc_freezes_before_and_records_the_collections_during():
    with QuietGC() as quiet:
        assert quiet.frozen > 0 and gc.get_freeze_count() > 0
        gc.collect()  # a full collection inside the run: recorded, scanning only what is new
    assert gc.get_freeze_count() == 0  # unfrozen after the run
    s = quiet.summary()
    assert s["full_collections"] >= 1 and s["collections"] >= s["full_collections"]
    assert 0 < s["max_pause_ms"] <= s["total_pause_ms"]
