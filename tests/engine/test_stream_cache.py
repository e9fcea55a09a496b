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


def test_dropping_kept_chunks_drops_the_windows_and_retained_kv_they_touch():
    import torch

    from qasr.engine.stream_cache import StreamState
    from qasr.model import audio as qaudio

    state = StreamState(windows=[torch.zeros(104, 4), torch.ones(104, 4)], kv_windows=2,
                        chunk_tokens=torch.zeros(3 * qaudio.TOKENS_PER_CHUNK, 4),
                        chunk_lows=[0.0] * 19, chunk_highs=[1.0] * 19, floor_max=1.0)
    state.keep_chunks(18)  # in the chunks past the windows: only tokens go
    assert (state.num_chunks, len(state.windows), state.kv_windows) == (18, 2, 2)
    assert state.chunk_tokens.shape[0] == 2 * qaudio.TOKENS_PER_CHUNK
    state.keep_chunks(11)  # inside window 1: it goes whole, with its chunks' tokens and its KV
    assert (state.num_chunks, len(state.windows), state.kv_windows, state.chunk_tokens) == (8, 1, 1, None)
    assert len(state.chunk_highs) == 8


def test_audio_that_does_not_continue_what_was_seen_is_told_apart():
    import numpy as np

    from qasr.engine.stream_cache import StreamState

    audio = np.random.default_rng(0).standard_normal(48000).astype(np.float32)
    state = StreamState()
    assert state.continues(audio[:100])  # nothing seen yet
    state.saw(audio[:32000])
    assert state.continues(audio) and state.continues(audio[:32000])
    assert not state.continues(audio[:31999])  # shorter than what was seen
    other = audio.copy()
    other[31990] += 1  # differs where the seen audio ended
    assert not state.continues(other)
    other = audio.copy()
    other[3] += 1  # ... or where it began
    assert not state.continues(other)
    state.kv_windows, state.chunk_lows, state.chunk_highs = 1, [0.0] * 8, [0.0] * 8
    state.windows = [np.zeros(1)]
    state.restart_audio()
    assert (state.num_samples, state.num_chunks, state.windows, state.kv_windows) == (0, 0, [], 0)
