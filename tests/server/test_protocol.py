"""The native protocol without sockets: what each client message parses to, and what each bad one is closed with."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from qasr.audio.g711 import MULAW_TO_LINEAR
from qasr.server.commands import Audio, End, Flush, Notice, Start
from qasr.server.errors import MalformedMessage, MessageTooBig, UnsupportedFormat
from qasr.server.limits import ServerLimits
from qasr.server.protocol import NativeProtocol, State, event_to_dict
from qasr.streaming import events
from qasr.streaming.settings import StreamLimits, StreamSettings, VadSettings


def started(**fields) -> NativeProtocol:
    protocol = NativeProtocol()
    protocol.receive(json.dumps({"type": "start", **fields}))
    return protocol


def test_a_bare_start_gets_the_documented_defaults():
    protocol = NativeProtocol()
    commands = protocol.receive('{"type": "start"}')
    assert commands == [Start(StreamSettings())]
    assert protocol.state is State.STREAMING
    assert protocol.settings == StreamSettings(sample_rate=16000, encoding="s16le", channels=1, language=None,
                                               context="", partials=True, partial_interval_ms=1000,
                                               vad=VadSettings(2, 500, 300, 30.0))
    assert protocol.format == "json"


def test_a_full_start_is_taken_as_given_and_the_language_normalised():
    message = {"type": "start", "sample_rate": 48000, "encoding": "f32le", "channels": 2, "multichannel": True,
               "language": "english",
               "context": "Names: Qasr", "format": "msgpack", "partials": False, "partial_interval_ms": 500,
               "vad": {"aggressiveness": 3, "end_silence_ms": 300, "pre_roll_ms": 0, "max_segment_s": 12},
               "words": True}
    protocol = NativeProtocol(stream_limits=StreamLimits(word_times=True))
    [start] = protocol.receive(json.dumps(message))
    assert start.settings == StreamSettings(48000, "f32le", 2, multichannel=True, language="English",
                                            context="Names: Qasr",
                                            partials=False, partial_interval_ms=500, vad=VadSettings(3, 300, 0, 12.0),
                                            words=True)
    assert protocol.format == "msgpack"
    assert protocol.config() == {key: value for key, value in message.items() if key != "type"} | {
        "language": "English", "vad": {"aggressiveness": 3, "end_silence_ms": 300, "pre_roll_ms": 0,
                                       "max_segment_s": 12.0}}


def test_server_defaults_fill_the_missing_fields():
    defaults = StreamSettings(partials=False, partial_interval_ms=700,
                              vad=VadSettings(aggressiveness=1, end_silence_ms=800, max_segment_s=20.0))
    [start] = NativeProtocol(defaults=defaults).receive('{"type": "start", "vad": {"pre_roll_ms": 100}}')
    assert start.settings.partials is False and start.settings.partial_interval_ms == 700
    assert start.settings.vad == VadSettings(1, 800, 100, 20.0)


@pytest.mark.parametrize("language", [None, "", "auto", " Auto "])
def test_no_language_means_detect(language):
    assert started(language=language).settings.language is None


def test_unknown_fields_are_not_fatal_but_noticed():
    commands = NativeProtocol().receive('{"type": "start", "colour": "red", "vad": {"mode": 1}}')
    assert isinstance(commands[0], Start)
    notices = commands[1:]
    assert [notice.code for notice in notices] == ["unknown_field", "unknown_field"]
    assert "colour" in notices[0].message and "mode" in notices[1].message
    [flush, notice] = started().receive('{"type": "flush", "now": true}')
    assert flush == Flush() and isinstance(notice, Notice)
    assert notice.code == "unknown_field" and "now" in notice.message


@pytest.mark.parametrize("field, value", [
    ("sample_rate", 7999), ("sample_rate", 192001), ("encoding", "u-law"), ("encoding", "s24le"),
    ("channels", 0), ("channels", 9), ("format", "xml"), ("language", "Klingon"),
])
def test_unsupported_formats_close_with_1003(field, value):
    with pytest.raises(UnsupportedFormat) as caught:
        NativeProtocol().receive(json.dumps({"type": "start", field: value}))
    assert caught.value.close_code == 1003 and caught.value.error_code == "unsupported"
    assert field.replace("_", " ").split()[0] in str(caught.value).replace("_", " ")


@pytest.mark.parametrize("message", [
    "not json", "", "[1, 2]", '"start"', '{"sample_rate": 16000}', '{"type": "begin"}', '{"type": "audio"}',
    '{"type": "flush"}', '{"type": "end"}',
    '{"type": "start", "sample_rate": "16k"}', '{"type": "start", "sample_rate": 16000.5}',
    '{"type": "start", "channels": true}', '{"type": "start", "encoding": 16}', '{"type": "start", "language": 5}',
    '{"type": "start", "partials": "yes"}', '{"type": "start", "partial_interval_ms": 50}',
    '{"type": "start", "partial_interval_ms": 60000}', '{"type": "start", "vad": 3}',
    '{"type": "start", "vad": {"aggressiveness": 4}}', '{"type": "start", "vad": {"end_silence_ms": 10}}',
    '{"type": "start", "vad": {"pre_roll_ms": -1}}', '{"type": "start", "vad": {"max_segment_s": 31}}',
    '{"type": "start", "vad": {"max_segment_s": 0.5}}', '{"type": "start", "vad": {"max_segment_s": NaN}}',
    '{"type": "start", "context": 7}', json.dumps({"type": "start", "context": "x" * 2001}),
    "[" * 100_000,  # nested deeper than the JSON parser recurses: a client mistake, not a server fault
])
def test_malformed_first_messages_close_with_1007(message):
    with pytest.raises(MalformedMessage) as caught:
        NativeProtocol().receive(message)
    assert caught.value.close_code == 1007 and caught.value.error_code == "malformed"


def test_a_pre_roll_longer_than_the_segment_allows_is_taken_and_clamped_by_the_vad():
    """Each within its documented range, so no 1007 (issue #14 item 4): the VAD uses a quarter of max_segment_s."""
    [start] = NativeProtocol().receive('{"type": "start", "vad": {"max_segment_s": 2, "pre_roll_ms": 2000}}')
    assert start.settings.vad == VadSettings(2, 500, 2000, 2.0)


def test_out_of_range_values_are_named_as_the_client_spells_them():
    with pytest.raises(MalformedMessage, match=r"vad\.end_silence_ms must be between 100 and 5000, got 10"):
        NativeProtocol().receive('{"type": "start", "vad": {"end_silence_ms": 10}}')
    with pytest.raises(MalformedMessage, match="partial_interval_ms must be between 200 and 10000"):
        NativeProtocol().receive('{"type": "start", "partial_interval_ms": 50}')


def test_audio_before_start_closes_with_1007():
    with pytest.raises(MalformedMessage, match="before `start`"):
        NativeProtocol().receive(b"\x00\x00")


def test_a_second_start_closes_with_1007():
    with pytest.raises(MalformedMessage, match="once"):
        started().receive('{"type": "start"}')


@pytest.mark.parametrize("fields, size", [({}, 3), ({"encoding": "f32le"}, 6), ({"channels": 2}, 6),
                                          ({"encoding": "f32le", "channels": 3}, 16)])
def test_a_partial_sample_closes_with_1007(fields, size):
    with pytest.raises(MalformedMessage, match="whole samples"):
        started(**fields).receive(bytes(size))


def test_nan_float_audio_closes_with_1007():
    with pytest.raises(MalformedMessage, match="NaN"):
        started(encoding="f32le").receive(np.array([0.0, np.nan], "<f4").tobytes())


def test_s16le_audio_decodes_to_float32_frames():
    [audio] = started().receive(np.array([0, 16384, -32768], "<i2").tobytes())
    assert isinstance(audio, Audio) and audio.samples.dtype == np.float32
    np.testing.assert_array_equal(audio.samples, [[0.0], [0.5], [-1.0]])


def test_f32le_stereo_keeps_its_channels_for_the_session_to_average():
    frames = np.array([[0.5, 0.25], [-1.0, 1.0], [0.2, 0.2]], "<f4")  # [samples, channels] interleaved
    [audio] = started(encoding="f32le", channels=2).receive(frames.tobytes())
    np.testing.assert_array_equal(audio.samples, frames)


@pytest.mark.parametrize("encoding", ["mulaw", "alaw"])
def test_g711_audio_is_taken(encoding):
    [start] = NativeProtocol().receive(json.dumps({"type": "start", "encoding": encoding, "sample_rate": 8000}))
    assert start.settings.encoding == encoding and start.settings.bytes_per_frame == 1
    protocol = started(encoding="mulaw", sample_rate=8000)
    [audio] = protocol.receive(bytes([0xFF, 0x80]))
    np.testing.assert_array_equal(audio.samples[:, 0], MULAW_TO_LINEAR[[0xFF, 0x80]] / 32768.0)


def test_empty_audio_frames_are_ignored():
    assert started().receive(b"") == []


def test_flush_and_end_and_what_comes_after_end():
    protocol = started()
    assert protocol.receive('{"type": "flush"}') == [Flush()]
    assert protocol.receive('{"type": "end"}') == [End()]
    assert protocol.state is State.ENDED
    [notice] = protocol.receive(b"\x00\x00")
    assert notice.code == "ignored"


def test_flush_may_name_one_channel_of_a_multichannel_stream():
    protocol = started(channels=2, multichannel=True)
    assert protocol.receive('{"type": "flush", "channel": 1}') == [Flush(1)]
    assert protocol.receive('{"type": "flush"}') == [Flush()]
    for channel in ("2", "-1", "true", '"0"'):
        with pytest.raises(MalformedMessage, match="channel must be an integer in 0..1"):
            protocol.receive(f'{{"type": "flush", "channel": {channel}}}')
    assert started().receive('{"type": "flush", "channel": 0}') == [Flush(0)]  # a mono stream's only channel
    with pytest.raises(MalformedMessage, match="0..0"):
        started(channels=2).receive('{"type": "flush", "channel": 1}')  # averaged: one channel of segments
    with pytest.raises(MalformedMessage, match="multichannel must be true or false"):
        started(multichannel="yes")


def test_channel_is_on_the_wire_only_for_multichannel_events():
    assert "channel" not in event_to_dict(events.Final(0, "hi", "English", 0.0, 1.0, "silence", 5.0))
    assert event_to_dict(events.Partial(3, "hi", "English", 0.0, 1.0, channel=1)) == {
        "type": "partial", "segment_id": 3, "text": "hi", "language": "English", "start": 0.0, "end": 1.0,
        "channel": 1}
    assert event_to_dict(events.SpeechStarted(0, 0.5, channel=0))["channel"] == 0


def test_messages_over_the_size_limit_close_with_1009():
    protocol = NativeProtocol(limits=ServerLimits(max_message_bytes=1024))
    with pytest.raises(MessageTooBig) as caught:
        protocol.receive(json.dumps({"type": "start", "context": "é" * 600}))  # 1200 bytes as UTF-8
    assert caught.value.close_code == 1009
    protocol.receive('{"type": "start"}')
    with pytest.raises(MessageTooBig):
        protocol.receive(bytes(1026))


def test_limits_narrow_what_a_start_may_ask_for():
    protocol = NativeProtocol(stream_limits=StreamLimits(max_sample_rate=48000, max_channels=2, max_segment_s=10),
                              defaults=StreamSettings(vad=VadSettings(max_segment_s=10)))
    with pytest.raises(UnsupportedFormat):
        protocol.receive('{"type": "start", "sample_rate": 96000}')
    with pytest.raises(UnsupportedFormat):
        protocol.receive('{"type": "start", "channels": 4}')
    with pytest.raises(MalformedMessage):
        protocol.receive('{"type": "start", "vad": {"max_segment_s": 20}}')
    [start] = protocol.receive('{"type": "start"}')
    assert start.settings.vad.max_segment_s == 10.0


ALL_EVENTS = [
    events.Ready("abc", "Qwen3-ASR-0.6B", 48000, 16000, {"max_message_bytes": 1024}),
    events.SpeechStarted(0, 0.25),
    events.Partial(0, "hello", "English", 0.25, 1.25),
    events.Final(0, "hello world", "English", 0.25, 1.5, "silence", 12.5),
    events.Error("unknown_field", "start: ignored unknown field(s) x", False),
    events.Summary(1, 2.0, 1.25),
]


def test_events_serialise_to_json_text_frames_by_default():
    protocol = NativeProtocol()
    frames = [frame for event in ALL_EVENTS for frame in protocol.encode(event)]
    assert all(isinstance(frame, str) for frame in frames)
    decoded = [json.loads(frame) for frame in frames]
    assert [message["type"] for message in decoded] == ["ready", "speech_started", "partial", "final", "error",
                                                        "summary"]
    assert decoded[3] == {"type": "final", "segment_id": 0, "text": "hello world", "language": "English",
                          "start": 0.25, "end": 1.5, "reason": "silence", "latency_ms": 12.5}
    [frame] = protocol.encode(events.Partial(1, "é中", "", 0, 1))
    assert json.loads(frame)["text"] == "é中"


def test_ready_carries_the_limits_and_the_streams_config_and_speech_ended_sends_nothing():
    protocol = NativeProtocol(limits=ServerLimits(max_message_bytes=4096))
    protocol.receive('{"type": "start", "sample_rate": 48000, "vad": {"pre_roll_ms": 0}}')
    [frame] = protocol.encode(events.Ready("abc", "Qwen3-ASR-0.6B", 48000, 16000))
    ready = json.loads(frame)
    assert ready["limits"] == {"max_message_bytes": 4096, "idle_timeout_s": 30.0, "sample_rates": [8000, 192000],
                               "max_channels": 8, "partial_interval_ms": [200, 10000], "max_context_chars": 2000,
                               "max_segment_s": 30.0, "words": False}
    assert ready["config"] == {"sample_rate": 48000, "encoding": "s16le", "channels": 1, "multichannel": False,
                               "language": None,
                               "context": "", "format": "json", "partials": True, "partial_interval_ms": 1000,
                               "vad": {"aggressiveness": 2, "end_silence_ms": 500, "pre_roll_ms": 0,
                                       "max_segment_s": 30.0}, "words": False}
    assert protocol.encode(events.SpeechEnded(0, 1.5)) == []
    assert protocol.greeting() == []


def test_events_serialise_to_msgpack_binary_frames_when_asked():
    protocol = started(format="msgpack")
    for event in ALL_EVENTS[1:]:
        [frame] = protocol.encode(event)
        assert isinstance(frame, bytes)
        assert msgpack.unpackb(frame, raw=False) == event_to_dict(event)


def test_errors_before_a_start_are_json_even_for_msgpack_clients():
    [frame] = NativeProtocol().encode(events.Error("server_full", "try later", True))
    assert isinstance(frame, str)


# -- word times (#17) ----------------------------------------------------------------------------------------------

def test_words_on_a_server_without_an_aligner_are_refused_with_1003_saying_why():
    with pytest.raises(UnsupportedFormat, match="no aligner loaded") as caught:
        NativeProtocol().receive('{"type": "start", "words": true}')
    assert caught.value.close_code == 1003 and caught.value.error_code == "unsupported"
    with pytest.raises(MalformedMessage, match="words must be true or false"):
        NativeProtocol(stream_limits=StreamLimits(word_times=True)).receive('{"type": "start", "words": "yes"}')


def test_ready_says_whether_word_times_are_available_and_what_the_stream_asked():
    for available in (False, True):
        protocol = NativeProtocol(stream_limits=StreamLimits(word_times=available))
        protocol.receive(json.dumps({"type": "start", "words": available}))
        [frame] = protocol.encode(events.Ready("s", "m", 16000, 16000))
        ready = json.loads(frame)
        assert ready["limits"]["words"] is available and ready["config"]["words"] is available


def test_a_final_carries_words_only_when_the_stream_asked():
    plain = events.Final(0, "hi there", "English", 1.0, 2.0, "silence", 5.0)
    assert "words" not in event_to_dict(plain) and "words_reason" not in event_to_dict(plain)
    timed = events.Final(0, "hi there", "English", 1.0, 2.0, "silence", 5.0,
                         words=(events.Word("hi", 1.1, 1.3), events.Word("there", 1.4, 1.9)))
    assert event_to_dict(timed)["words"] == [{"word": "hi", "start": 1.1, "end": 1.3},
                                             {"word": "there", "start": 1.4, "end": 1.9}]
    assert "words_reason" not in event_to_dict(timed)
    none = events.Final(0, "marhaba", "Arabic", 1.0, 2.0, "silence", 5.0, words=(),
                        words_reason="the aligner does not support Arabic")
    assert event_to_dict(none)["words"] == [] and "Arabic" in event_to_dict(none)["words_reason"]
    protocol = NativeProtocol(stream_limits=StreamLimits(word_times=True))
    protocol.receive('{"type": "start", "words": true, "format": "msgpack"}')
    assert msgpack.unpackb(protocol.encode(timed)[0])["words"][1] == {"word": "there", "start": 1.4, "end": 1.9}
