"""The Telnyx adapter without sockets: formats, frames out of order, Telnyx's own error events."""

from __future__ import annotations

import json

import numpy as np
import pytest
from call_replay import telnyx_call

from qasr.server.calls import CallRegistry
from qasr.server.commands import Audio, End, Notice, Start
from qasr.server.errors import MalformedMessage, UnsupportedFormat
from qasr.server.telnyx import TelnyxAdapter
from qasr.streaming.settings import StreamLimits, StreamSettings

RATE = 8000


def adapter(registry: CallRegistry | None = None, **options) -> TelnyxAdapter:
    return TelnyxAdapter(defaults=StreamSettings(), limits=StreamLimits(),
                         calls=registry if registry is not None else CallRegistry(), **options)


def tone(frequency: float, seconds: float) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * frequency * np.arange(int(seconds * RATE)) / RATE)).astype(np.float32)


def feed(telnyx: TelnyxAdapter, frames) -> list:
    commands = []
    for _, frame in frames:
        commands += telnyx.receive(frame)
    return commands


def audio_of(commands) -> np.ndarray:
    return np.concatenate([command.samples for command in commands if isinstance(command, Audio)])


@pytest.mark.parametrize("encoding, wire, tolerance", [("PCMU", "mulaw", 0.02), ("PCMA", "alaw", 0.02),
                                                       ("L16", "s16le", 1e-4)])
def test_each_encoding_decodes_to_the_same_audio(encoding, wire, tolerance):
    caller = tone(300, 0.2)
    commands = feed(adapter(), telnyx_call(caller, None, encoding=encoding))
    assert isinstance(commands[0], Start) and commands[0].settings.encoding == wire
    assert isinstance(commands[-1], End)
    np.testing.assert_allclose(audio_of(commands)[:, 0], caller, atol=tolerance)


def test_frames_out_of_order_come_out_in_order_and_both_tracks_line_up():
    caller, agent = tone(300, 1.0), tone(700, 1.0)
    frames = telnyx_call(caller, agent, shuffle_seed=3)
    plain = telnyx_call(caller, agent)
    assert [frame for _, frame in frames] != [frame for _, frame in plain]  # the shuffle did swap some
    telnyx = adapter()
    audio = audio_of(feed(telnyx, frames))
    np.testing.assert_allclose(audio[:, 0], caller, atol=0.02)
    np.testing.assert_allclose(audio[:, 1], agent, atol=0.02)
    assert telnyx.reorder.lost == 0 and telnyx.reorder.dropped == 0


def test_a_frame_later_than_the_window_is_dropped_with_a_notice_and_its_audio_becomes_silence():
    caller = tone(300, 0.4)
    frames = telnyx_call(caller, None)
    late = frames.pop(4)  # the third media frame (sequence 4) comes after six others
    frames.insert(10, late)
    telnyx = adapter(reorder_window=4)
    commands = feed(telnyx, frames)
    notices = [c for c in commands if isinstance(c, Notice)]
    assert [n.code for n in notices] == ["out_of_order"] and telnyx.reorder.lost == 1
    audio = audio_of(commands)[:, 0]
    assert len(audio) == len(caller)
    np.testing.assert_array_equal(audio[320:480], 0.0)
    np.testing.assert_allclose(audio[480:], caller[480:], atol=0.02)


def test_frames_that_overtake_start_are_held_until_it_comes():
    frames = telnyx_call(tone(300, 0.1), None)
    frames[1], frames[2] = frames[2], frames[1]
    commands = feed(adapter(), frames)
    assert isinstance(commands[0], Start)
    assert len(audio_of(commands)) == 800


def test_dtmf_reaches_the_call_at_its_place_in_the_audio():
    registry = CallRegistry()
    telnyx = adapter(registry)
    feed(telnyx, telnyx_call(tone(300, 0.3), None, call_control_id="v3:abc", dtmf=[(0.2, "#")],
                             parameters=[{"name": "ticket", "value": "7"}]))
    telnyx.close()
    call = registry.get("v3:abc")
    messages = list(call._replay)
    assert messages[0]["parameters"] == {"ticket": "7"} and messages[0]["metadata"]["from"] == "+15550100"
    dtmf = next(m for m in messages if m["type"] == "dtmf")
    assert (dtmf["digit"], dtmf["time"], dtmf["speaker"]) == ("#", 0.2, "caller")
    assert messages[-1]["summary"]["dtmf"] == "#"


def test_telnyx_error_events_become_notices():
    telnyx = adapter()
    frames = telnyx_call(tone(300, 0.02), None)
    feed(telnyx, frames[:-1])
    [notice] = telnyx.receive(json.dumps({"event": "error", "sequence_number": "3", "stream_id": "x",
                                          "payload": {"code": 100002, "title": "Unknown error",
                                                      "detail": "media lost"}}))
    assert notice.code == "platform_error" and "media lost" in notice.message


@pytest.mark.parametrize("change, error, match", [
    ({"encoding": "OPUS"}, UnsupportedFormat, "OPUS"),
    ({"encoding": "PCMU", "sample_rate": 16000}, UnsupportedFormat, "8000 Hz"),
    ({"encoding": "L16", "sample_rate": "fast"}, MalformedMessage, "integer sample_rate"),
])
def test_unsupported_or_malformed_media_formats(change, error, match):
    start = json.loads(telnyx_call(tone(300, 0.02), None)[1][1])
    start["start"]["media_format"].update(change)
    with pytest.raises(error, match=match):
        adapter().receive(json.dumps(start))


def test_too_many_frames_before_start_is_malformed():
    frames = telnyx_call(tone(300, 0.5), None)
    telnyx = adapter(reorder_window=4)
    telnyx.receive(frames[0][1])
    with pytest.raises(MalformedMessage, match="before `start`"):
        for _, frame in frames[2:]:
            telnyx.receive(frame)
