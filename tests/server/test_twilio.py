"""The Twilio Media Streams adapter without sockets: Twilio's frames in, commands out, the call's events published."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from call_replay import twilio_call

from qasr.audio import decode_pcm
from qasr.server.calls import CallRegistry
from qasr.server.commands import Audio, End, Notice, Start
from qasr.server.errors import MalformedMessage, UnsupportedFormat
from qasr.server.twilio import TwilioAdapter
from qasr.streaming import events
from qasr.streaming.settings import StreamLimits, StreamSettings

RATE = 8000


def adapter(registry: CallRegistry | None = None) -> TwilioAdapter:
    return TwilioAdapter(defaults=StreamSettings(), limits=StreamLimits(),
                         calls=registry if registry is not None else CallRegistry())


def tone(frequency: float, seconds: float) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * frequency * np.arange(int(seconds * RATE)) / RATE)).astype(np.float32)


def feed(twilio: TwilioAdapter, frames) -> list:
    commands = []
    for _, frame in frames:
        commands += twilio.receive(frame)
    return commands


def subscription_messages(registry: CallRegistry, call_id: str) -> list[dict]:
    async def take():
        subscription = registry.subscribe(call_id)
        return [message async for message in subscription]
    return asyncio.run(asyncio.wait_for(take(), 1))


def test_both_tracks_become_one_two_channel_stream_with_each_track_on_its_channel():
    caller, agent = tone(300, 0.2), tone(700, 0.2)
    twilio = adapter()
    commands = feed(twilio, twilio_call(caller, agent))
    start = commands[0]
    assert isinstance(start, Start)
    assert (start.settings.sample_rate, start.settings.encoding, start.settings.channels,
            start.settings.multichannel) == (8000, "mulaw", 2, True)
    assert isinstance(commands[-1], End)
    audio = np.concatenate([command.samples for command in commands if isinstance(command, Audio)])
    assert audio.shape == (len(caller), 2)
    np.testing.assert_allclose(audio[:, 0], caller, atol=0.02)  # mu-law's quantisation
    np.testing.assert_allclose(audio[:, 1], agent, atol=0.02)


def test_an_inbound_only_stream_is_mono_and_its_custom_parameters_set_language_and_context():
    twilio = adapter()
    frames = twilio_call(tone(300, 0.1), None, parameters={"qasr_language": "en-US", "qasr_context": "Acme"})
    [start, *rest] = feed(twilio, frames)
    assert (start.settings.channels, start.settings.multichannel) == (1, False)
    assert (start.settings.language, start.settings.context) == ("English", "Acme")
    assert sum(len(c.samples) for c in rest if isinstance(c, Audio)) == 800


def test_the_call_hears_start_dtmf_transcripts_by_speaker_and_one_summary():
    registry = CallRegistry()
    twilio = adapter(registry)
    feed(twilio, twilio_call(tone(300, 0.3), tone(700, 0.3), call_sid="CA9", dtmf=[(0.1, "7")],
                             parameters={"crm": "42"}))
    twilio.encode(events.Final(0, "hello", "English", 0.0, 0.2, "silence", 5.0))
    agent_final = events.Final(0, "hi there", "English", 0.1, 0.3, "end", 5.0)
    object.__setattr__(agent_final, "channel", 1)  # what a multichannel stream's events carry
    twilio.encode(agent_final)
    assert twilio.encode(events.Summary(1, 0.3, 0.2)) == []  # nothing goes back to Twilio
    twilio.close()
    messages = subscription_messages(registry, "CA9")
    assert [m["type"] for m in messages] == ["call_started", "dtmf", "final", "final", "call_ended"]
    assert messages[0]["parameters"] == {"crm": "42"} and messages[0]["platform"] == "twilio"
    assert (messages[1]["digit"], messages[1]["speaker"], messages[1]["time"]) == ("7", "caller", 0.1)
    assert [(m["speaker"], m["text"]) for m in messages[2:4]] == [("caller", "hello"), ("agent", "hi there")]
    summary = messages[-1]["summary"]
    assert messages[-1]["reason"] == "stop" and summary["dtmf"] == "7" and summary["audio_seconds"] == 0.3


def test_a_connection_lost_without_stop_still_ends_the_call():
    registry = CallRegistry()
    twilio = adapter(registry)
    feed(twilio, twilio_call(tone(300, 0.1), None, call_sid="CA2")[:-1])
    twilio.close()
    assert subscription_messages(registry, "CA2")[-1]["reason"] == "disconnected"


def test_a_lost_frame_is_replaced_by_silence_of_its_length():
    frames = twilio_call(tone(300, 0.1), None)
    del frames[4]  # the third 20 ms media frame
    commands = feed(adapter(), frames)
    audio = np.concatenate([c.samples for c in commands if isinstance(c, Audio)])
    assert audio.shape == (800, 1)
    np.testing.assert_array_equal(audio[320:480, 0], 0.0)


def test_a_repeated_sequence_number_is_dropped_with_a_notice():
    frames = twilio_call(tone(300, 0.06), None)
    twilio = adapter()
    feed(twilio, frames[:3])
    [notice] = twilio.receive(frames[2][1])
    assert isinstance(notice, Notice) and notice.code == "out_of_order"


def test_unknown_events_are_noticed_and_marks_ignored():
    twilio = adapter()
    feed(twilio, twilio_call(tone(300, 0.02), None)[:2])
    assert twilio.receive(json.dumps({"event": "mark", "sequenceNumber": "5", "mark": {"name": "x"}})) == []
    [notice] = twilio.receive(json.dumps({"event": "telepathy", "sequenceNumber": "6"}))
    assert notice.code == "unknown_event"


@pytest.mark.parametrize("frame, match", [
    ("not json", "JSON"),
    ('{"event": "media", "sequenceNumber": "1", "media": {}}', "before `start`"),
    ('{"no": "event"}', '"event"'),
    # found by the fuzz run: a top-level streamSid that is not a string escaped as a TypeError
    ('{"event": "start", "sequenceNumber": "1", "streamSid": ["MZ"], "start": {"callSid": "CA", "tracks": ["inbound"],'
     ' "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}', "streamSid has the wrong type"),
    # found by the nightly fuzz: an empty callSid escaped as the call registry's ValueError
    ('{"event": "start", "sequenceNumber": "1", "streamSid": "MZ", "start": {"callSid": "", "tracks": ["inbound"],'
     ' "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}', "call id is empty"),
])
def test_malformed_frames_close_the_connection(frame, match):
    with pytest.raises(MalformedMessage, match=match):
        adapter().receive(frame)


def test_media_frames_are_checked():
    frames = twilio_call(tone(300, 0.02), None)
    twilio = adapter()
    feed(twilio, frames[:2])
    media = json.loads(frames[2][1])
    with pytest.raises(MalformedMessage, match="binary"):
        twilio.receive(b"\x00\x01")
    for n, (change, match) in enumerate((({"payload": "***"}, "base64"), ({"track": "sideways"}, "not one of"))):
        broken = {**media, "sequenceNumber": str(int(media["sequenceNumber"]) + 10 + n),
                  "media": {**media["media"], **change}}
        with pytest.raises(MalformedMessage, match=match):
            twilio.receive(json.dumps(broken))
    with pytest.raises(MalformedMessage, match="not this stream's"):
        twilio.receive(json.dumps({**media, "sequenceNumber": "99", "streamSid": "MZother"}))


def test_media_frames_of_less_usual_shapes_are_read_or_refused_as_the_checks_say():
    frames = twilio_call(tone(300, 0.06), None)
    twilio = adapter()
    feed(twilio, frames[:2])
    media = [json.loads(frame) for _, frame in frames[2:5]]
    media[1]["media"]["timestamp"] = 20  # a number, not Twilio's string: accepted as the same time
    del media[2]["media"]["timestamp"]  # none: placed right after the audio before it
    blocks = [command.samples for frame in media for command in twilio.receive(json.dumps(frame))]
    assert [len(block) for block in blocks] == [160, 160, 160] and twilio.aligner.silence_inserted == [0]
    for n, (change, match) in enumerate((({"timestamp": "-20"}, "media.timestamp"),
                                         ({"timestamp": "²"}, "whole number"),
                                         ({"timestamp": True}, "media.timestamp has the wrong type"),
                                         ({"payload": 7}, "media.payload has the wrong type"),
                                         ({"track": "sideways", "timestamp": "x"}, "not one of"))):  # track first
        broken = {**media[0], "sequenceNumber": str(10 + n), "media": {**media[0]["media"], **change}}
        with pytest.raises(MalformedMessage, match=match):
            twilio.receive(json.dumps(broken))


def test_a_media_format_other_than_8khz_mulaw_is_unsupported():
    start = json.loads(twilio_call(tone(300, 0.02), None)[1][1])
    start["start"]["mediaFormat"]["sampleRate"] = 16000
    with pytest.raises(UnsupportedFormat, match="audio/x-mulaw at 8000"):
        adapter().receive(json.dumps(start))


def test_after_stop_nothing_more_is_read():
    twilio = adapter()
    feed(twilio, twilio_call(tone(300, 0.02), None))
    assert twilio.receive('{"event": "media"}') == []


def test_decoding_matches_the_shared_g711_table():
    caller = tone(440, 0.02)
    commands = feed(adapter(), twilio_call(caller, None))
    [audio] = [c for c in commands if isinstance(c, Audio)]
    from call_replay import mulaw
    np.testing.assert_array_equal(audio.samples[:, 0], decode_pcm(mulaw(caller), "mulaw")[:, 0])


def test_a_dtmf_track_that_is_not_a_string_is_malformed():
    """Found by the nightly fuzz: a list as the dtmf track escaped as an AttributeError."""
    frames = twilio_call(tone(300, 0.02), None)
    twilio = adapter()
    feed(twilio, frames[:2])
    dtmf = {"event": "dtmf", "streamSid": json.loads(frames[1][1])["streamSid"], "sequenceNumber": "50",
            "dtmf": {"track": ["inbound_track"], "digit": "5"}}
    with pytest.raises(MalformedMessage, match="dtmf.track has the wrong type"):
        twilio.receive(json.dumps(dtmf))
