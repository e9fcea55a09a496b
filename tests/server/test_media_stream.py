"""What Twilio and Telnyx share: lining up interleaved tracks, filling lost audio, and putting frames back in order."""

from __future__ import annotations

import numpy as np
import pytest

from qasr.server.errors import MalformedMessage
from qasr.server.media_stream import ReorderBuffer, TrackAligner, custom_parameters, field, number


def ramp(start: float, n: int) -> np.ndarray:
    return (start + np.arange(n, dtype=np.float32)) / 1000.0


def test_interleaved_tracks_come_out_side_by_side_once_both_have_the_samples():
    aligner = TrackAligner(2, gap_tolerance=10, max_skew=1000)
    assert aligner.push(0, ramp(0, 160)).shape == (0, 2)
    block = aligner.push(1, ramp(500, 100))
    assert block.shape == (100, 2)
    np.testing.assert_array_equal(block[:, 0], ramp(0, 100))
    np.testing.assert_array_equal(block[:, 1], ramp(500, 100))
    block = aligner.push(1, ramp(600, 100))
    np.testing.assert_array_equal(block[:, 0], ramp(100, 60))
    tail = aligner.flush()
    assert tail.shape == (40, 2)
    np.testing.assert_array_equal(tail[:, 0], 0.0)  # the shorter track is padded at the end


def test_a_track_that_stops_sending_is_padded_so_the_other_is_not_held_up_beyond_the_skew():
    aligner = TrackAligner(2, gap_tolerance=10, max_skew=300)
    out = [aligner.push(0, ramp(0, 160)) for _ in range(4)]  # 640 samples on track 0, none on track 1
    assert sum(len(block) for block in out) == 640 - 300
    assert aligner.silence_inserted == [0, 340]


def test_a_timestamp_beyond_the_received_audio_inserts_silence_but_jitter_does_not():
    aligner = TrackAligner(1, gap_tolerance=10, max_skew=1000)
    aligner.push(0, ramp(1, 160), at=0)
    block = aligner.push(0, ramp(1, 160), at=165)  # 5 samples of jitter: placed right after
    assert len(block) == 160
    block = aligner.push(0, ramp(1, 160), at=640)  # two 20 ms frames lost upstream
    assert len(block) == 320 + 160
    np.testing.assert_array_equal(block[:320, 0], 0.0)
    assert aligner.position(0) == 800


def test_one_tracks_frames_come_out_as_they_are_and_its_timeline_still_counts_them():
    aligner = TrackAligner(1, gap_tolerance=10, max_skew=1000)
    frames = [np.arange(160, dtype=np.float32) + 160 * k for k in range(3)]
    blocks = [aligner.push(0, frame, at=160 * k) for k, frame in enumerate(frames)]
    for frame, block in zip(frames, blocks):
        assert block.shape == (160, 1) and block.dtype == np.float32
        np.testing.assert_array_equal(block[:, 0], frame)
    assert aligner.position(0) == 480
    block = aligner.push(0, frames[0], at=800)  # a gap after the passed-through frames is still filled
    assert len(block) == 320 + 160 and aligner.silence_inserted == [320] and aligner.position(0) == 960
    assert len(aligner.flush()) == 0


def test_the_reorder_buffer_restores_order_within_its_window():
    buffer = ReorderBuffer(window=4)
    out = []
    for sequence in (1, 3, 2, 5, 4, 6):
        out += buffer.push(sequence, {"n": sequence})
    assert [m["n"] for m in out] == [1, 2, 3, 4, 5, 6]
    assert buffer.push(3, {"n": 3}) == [] and buffer.dropped == 1  # after its turn


def test_a_number_that_never_comes_is_given_up_once_the_window_is_full():
    buffer = ReorderBuffer(window=3)
    out = buffer.push(1, {"n": 1})
    for sequence in (3, 4, 5):
        out += buffer.push(sequence, {"n": sequence})
    assert [m["n"] for m in out] == [1]
    out = buffer.push(6, {"n": 6})
    assert [m["n"] for m in out] == [3, 4, 5, 6] and buffer.lost == 1
    assert buffer.push(2, {"n": 2}) == []  # too late now


def test_flush_hands_out_what_is_held_in_order():
    buffer = ReorderBuffer(window=8)
    buffer.push(1, {"n": 1})
    buffer.push(4, {"n": 4})
    buffer.push(3, {"n": 3})
    assert [m["n"] for m in buffer.flush()] == [3, 4]


def test_field_and_number_name_what_is_wrong():
    message = {"event": "media", "media": {"chunk": "7", "track": 3, "timestamp": "-1"}}
    assert number(message, "media.chunk") == 7
    with pytest.raises(MalformedMessage, match="media.payload is missing"):
        field(message, "media.payload")
    with pytest.raises(MalformedMessage, match="media.track has the wrong type"):
        field(message, "media.track")
    with pytest.raises(MalformedMessage, match=">= 0"):
        number(message, "media.timestamp")


def test_custom_parameters_as_an_object_or_a_list_of_names_and_values():
    assert custom_parameters({"a": 1}) == {"a": "1"}
    assert custom_parameters([{"name": "a", "value": "x"}, {"name": "b"}]) == {"a": "x", "b": ""}
    assert custom_parameters(None) == {}
    with pytest.raises(MalformedMessage):
        custom_parameters("a=b")
