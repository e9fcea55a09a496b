"""The per-stream cache's bookkeeping: retained KV slots are shared LRU-fashion and everything stays bounded."""

from qasr.engine.stream_cache import StreamCache


def test_retained_slots_are_reused_least_recently_used_first_and_busy_streams_keep_theirs():
    cache = StreamCache(range(10, 12))
    assert cache.retained_slot("a", busy=set()) == 10
    assert cache.retained_slot("b", busy=set()) == 11
    assert cache.retained_slot("a", busy=set()) == 10  # its own
    cache.get("a")  # a used more recently than b
    assert cache.retained_slot("c", busy=set()) == 11  # taken from b, the least recently used
    assert cache.peek("b").retained_slot == -1 and cache.peek("b").kv_windows == 0
    assert cache.retained_slot("d", busy={"a", "c"}) == -1  # nothing free and everyone else busy


def test_release_returns_the_slot_and_the_number_of_streams_is_bounded():
    cache = StreamCache(range(0, 1), max_streams=3)
    cache.retained_slot("a", busy=set())
    cache.release("a")
    assert cache.peek("a") is None and cache.retained_slot("b", busy=set()) == 0
    for name in "cdef":
        cache.get(name)
    assert len(cache) == 3 and cache.peek("b") is None  # b (least recent) dropped, and its slot freed
    assert cache.retained_slot("g", busy=set()) == 0
