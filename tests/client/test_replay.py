"""SentAudio (what a connection sent, kept for a reconnect) and how AudioStream carries a drained server's unread
audio over to the next connection: sent again, lost beyond the replay window, or dropped when it was read after all."""

from __future__ import annotations

import types

import numpy as np
import pytest

from qasr.client import StreamOptions
from qasr.client.replay import SentAudio
from qasr.client.stream import AudioStream


def chunks(*lengths: int, start: int = 0) -> list[np.ndarray]:
    """Consecutive chunks whose samples are their own frame numbers (so any cut shows where it fell)."""
    out, at = [], start
    for length in lengths:
        out.append(np.arange(at, at + length, dtype=np.float32))
        at += length
    return out


def test_the_tail_is_the_last_frames_sent_in_order_the_first_chunk_cut_to_fit():
    sent = SentAudio(window_samples=1000)
    for chunk in chunks(100, 100, 100):
        sent.add(chunk)
    assert np.concatenate(sent.tail(150)).tolist() == list(range(150, 300))
    assert [len(chunk) for chunk in sent.tail(150)] == [50, 100]
    assert np.concatenate(sent.tail(10_000)).tolist() == list(range(300))  # never more than it holds
    assert sent.tail(0) == [] and sent.tail(-5) == []


def test_only_the_window_is_kept_in_whole_chunks_and_a_reused_buffer_cannot_change_it():
    sent = SentAudio(window_samples=250)
    buffer = np.zeros(100, dtype=np.float32)
    for value in range(5):  # a source that refills one buffer
        buffer[:] = value
        sent.add(buffer)
    assert sent.num_samples == 300  # the oldest chunks went once the rest still covered 250 frames
    assert [chunk[0] for chunk in sent.tail(300)] == [2.0, 3.0, 4.0]
    sent.clear()
    assert sent.num_samples == 0 and sent.tail(100) == []


def test_a_zero_window_keeps_nothing_and_a_negative_one_is_refused():
    sent = SentAudio(window_samples=0)
    sent.add(np.ones(100, dtype=np.float32))
    assert sent.num_samples == 0
    with pytest.raises(ValueError, match="window_samples"):
        SentAudio(window_samples=-1)


def stream_that_sent(lengths, *, replay_s: float) -> AudioStream:
    async def nothing():
        yield np.zeros(0, dtype=np.float32)

    stream = AudioStream("ws://127.0.0.1:1/v1/stream", nothing(), StreamOptions(sample_rate=1000), reconnect=1,
                         replay_s=replay_s)
    for chunk in chunks(*lengths):
        stream._sent.add(chunk)
    return stream


def connection(samples_sent: int, unheard: int | None):
    return types.SimpleNamespace(samples_sent=samples_sent, unheard_samples=unheard, ready=object())


def test_unread_audio_goes_first_on_the_next_connection_and_the_timeline_covers_only_what_was_read():
    stream = stream_that_sent([100, 100, 100], replay_s=10)
    stream._pending.append(np.full(100, -1, dtype=np.float32))  # a chunk whose send failed: after the unread audio
    assert stream._carry_over_unread(connection(300, unheard=120)) == (180, 120, 0)
    assert np.concatenate(stream._pending).tolist() == list(range(180, 300)) + [-1] * 100
    assert stream._sent.num_samples == 0  # the next connection's audio starts afresh


def test_unread_audio_older_than_the_window_is_lost_and_the_timeline_steps_over_it():
    stream = stream_that_sent([100, 100, 100], replay_s=0.15)  # holds the last 200 frames
    assert stream._carry_over_unread(connection(300, unheard=290)) == (100, 200, 90)
    assert np.concatenate(stream._pending).tolist() == list(range(100, 300))


def test_a_chunk_cut_short_that_the_server_did_read_is_not_sent_twice():
    stream = stream_that_sent([100], replay_s=10)
    stream._pending.append(np.arange(100, 200, dtype=np.float32))  # counted as unsent; the server read 30 of it
    assert stream._carry_over_unread(connection(100, unheard=-30)) == (130, 0, 0)
    assert np.concatenate(stream._pending).tolist() == list(range(130, 200))


def test_without_a_summary_nothing_is_sent_again():
    stream = stream_that_sent([100, 100], replay_s=10)
    assert stream._carry_over_unread(connection(200, unheard=None)) == (200, 0, 0)
    assert not stream._pending


def test_a_negative_replay_window_is_refused():
    with pytest.raises(ValueError, match="replay_s"):
        stream_that_sent([], replay_s=-1)
