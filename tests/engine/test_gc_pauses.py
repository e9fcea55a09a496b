"""GcPauses counts and times every garbage collection, by generation, and lets go when stopped."""

import gc

from qasr.engine.gc_pauses import GcPauses


def test_every_collection_is_counted_by_generation_and_timed():
    pauses = GcPauses.watch()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.stop()
    assert pauses.count[0] >= 1 and pauses.count[2] >= 2
    assert pauses.seconds[2] > 0 and 0 < pauses.longest[2] <= pauses.seconds[2]
    assert pauses.longest_pause == max(pauses.longest)
    assert "generation 2: " in pauses.summary()
    before = list(pauses.count)
    gc.collect(2)  # stopped: not counted
    assert pauses.count == before and pauses._callback not in gc.callbacks
