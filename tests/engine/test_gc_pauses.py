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


def test_the_loaded_heap_is_frozen_out_of_the_collectors_walk_and_thawed():
    from qasr.engine.gc_pauses import freeze_loaded_heap, thaw

    kept = [[i] for i in range(50_000)]  # long-lived objects, as a loaded engine's
    try:
        frozen = freeze_loaded_heap()
        # a frozen object whose last reference goes (another test's thread winding down) leaves the frozen count:
        # it can only shrink, never below what is still held
        assert len(kept) <= gc.get_freeze_count() <= frozen
        assert len(gc.get_objects()) < len(kept)  # a full collection no longer walks them
        pauses = GcPauses()
        assert len(kept) <= pauses.frozen <= frozen
        assert pauses.summary().startswith(f"{pauses.frozen} objects frozen; ")
    finally:
        thaw()
    assert gc.get_freeze_count() == 0 and len(gc.get_objects()) >= len(kept)
