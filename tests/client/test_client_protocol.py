"""The client's side of the wire, without sockets: start messages, audio frames, event parsing."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from qasr.audio import decode_pcm
from qasr.client.errors import ProtocolMismatch
from qasr.client.protocol import END, FLUSH, StreamOptions, encode_audio, parse_event, start_message
from qasr.server.commands import Start
from qasr.server.protocol import NativeProtocol
from qasr.streaming.events import Final, Ready, Summary, Word
from qasr.streaming.settings import StreamLimits


def test_the_start_message_is_what_the_server_parses():
    options = StreamOptions(sample_rate=48000, encoding="f32le", channels=2, language="german", context="Müller",
                            format="msgpack", partials=False, partial_interval_ms=700,
                            vad={"end_silence_ms": 800, "aggressiveness": 3})
    protocol = NativeProtocol()
    start, *notices = protocol.receive(start_message(options))
    assert isinstance(start, Start) and not notices
    config = start.settings
    assert (config.sample_rate, config.encoding, config.channels, config.language, config.context, protocol.format,
            config.partials, config.partial_interval_ms) == (48000, "f32le", 2, "German", "Müller", "msgpack",
                                                             False, 700)
    assert (config.vad.end_silence_ms, config.vad.aggressiveness) == (800, 3)


def test_defaults_leave_server_settings_alone():
    message = json.loads(start_message(StreamOptions()))
    assert "partial_interval_ms" not in message and "vad" not in message
    assert "words" not in message  # a server without an aligner refuses `words` even when false would do
    assert message["language"] is None and message["sample_rate"] == 16000
    assert json.loads(END) == {"type": "end"} and json.loads(FLUSH) == {"type": "flush"}


@pytest.mark.parametrize("bad, match", [
    ({"sample_rate": 0}, "sample_rate"), ({"sample_rate": 16000.0}, "sample_rate"), ({"encoding": "mp3"}, "encoding"),
    ({"format": "xml"}, "format"), ({"channels": 0}, "channels"), ({"words": "yes"}, "words"),
])
def test_bad_options_are_value_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        StreamOptions(**bad)


def test_audio_frames_round_trip_through_the_servers_decoder():
    samples = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 1.5], np.float32)
    for encoding in ("s16le", "f32le"):
        options = StreamOptions(encoding=encoding)
        protocol = NativeProtocol()
        protocol.receive(start_message(options))
        [audio] = protocol.receive(encode_audio(samples, options))
        assert np.allclose(audio.samples[:, 0], np.clip(samples, -1, 1), atol=1 / 32767)
    assert encode_audio(np.array([1, -2], np.int16), StreamOptions()) == b"\x01\x00\xfe\xff"
    assert encode_audio(np.array([0.5], np.float32), StreamOptions()) == np.int16(16384).tobytes()


@pytest.mark.parametrize("encoding", ["mulaw", "alaw"])
def test_g711_frames_carry_the_nearest_level_the_servers_decoder_has(encoding):
    samples = np.array([0.0, 0.3, -0.3, 0.001, -0.7, 1.0, -1.5], np.float32)
    options = StreamOptions(sample_rate=8000, encoding=encoding)
    frame = encode_audio(samples, options)
    assert len(frame) == len(samples)  # one byte per sample
    protocol = NativeProtocol()
    protocol.receive(start_message(options))
    [audio] = protocol.receive(frame)
    levels = decode_pcm(bytes(range(256)), encoding)[:, 0]
    clipped = np.clip(samples, -1, 1)
    nearest = np.abs(clipped[:, None] - levels[None, :]).min(axis=1)  # A-law's 0 is halfway: either level will do
    np.testing.assert_array_equal(np.abs(audio.samples[:, 0] - clipped), nearest)
    as_int16 = np.round(clipped * 32767).astype(np.int16)
    assert encode_audio(as_int16, options) == encode_audio(as_int16 / np.float32(32768), options)


def test_channels_are_checked_and_interleaved():
    stereo = StreamOptions(channels=2)
    frames = np.array([[0.1, 0.2], [0.3, 0.4]], np.float32)  # [samples, channels]
    assert encode_audio(frames, stereo) == encode_audio(frames.reshape(-1), stereo)
    with pytest.raises(ValueError, match="3 channels"):
        encode_audio(np.zeros((4, 3), np.float32), stereo)
    with pytest.raises(ValueError, match="does not split"):
        encode_audio(np.zeros(3, np.float32), stereo)
    with pytest.raises(ValueError, match="float or int16"):
        encode_audio(np.zeros(3, np.int32), StreamOptions())


def test_events_parse_from_json_and_msgpack_ignoring_what_is_new():
    final = {"type": "final", "segment_id": 2, "text": "Hallo.", "language": "German", "start": 1.5, "end": 2.25,
             "reason": "silence", "latency_ms": 80.5, "confidence": 0.9}  # a field from a newer server
    expected = Final(2, "Hallo.", "German", 1.5, 2.25, "silence", 80.5)
    assert parse_event(json.dumps(final)) == expected
    assert parse_event(msgpack.packb(final)) == expected
    assert parse_event('{"type": "summary", "segments": 1, "audio_seconds": 3.0, "speech_seconds": 0.75}') == \
        Summary(1, 3.0, 0.75)
    assert isinstance(parse_event(json.dumps({"type": "ready", "session_id": "s", "model": "m", "sample_rate": 16000,
                                              "engine_sample_rate": 16000})), Ready)
    assert parse_event('{"type": "speech_rate", "words_per_minute": 140}') is None  # an event type from the future


@pytest.mark.parametrize("frame, match", [
    ("not json", "neither JSON nor msgpack"), ("[1, 2]", "without an event type"),
    ('{"type": "final", "segment_id": 1}', "not what this client expects"),
])
def test_frames_that_are_not_events_are_protocol_mismatches(frame, match):
    with pytest.raises(ProtocolMismatch, match=match):
        parse_event(frame)


def test_words_are_asked_for_in_start_and_a_servers_start_takes_them():
    message = start_message(StreamOptions(words=True))
    assert json.loads(message)["words"] is True
    start, = NativeProtocol(stream_limits=StreamLimits(word_times=True)).receive(message)
    assert start.settings.words is True


def test_a_finals_words_parse_into_word_times_and_words_reason_is_kept():
    final = {"type": "final", "segment_id": 0, "text": "Hello, world.", "language": "English", "start": 0.18,
             "end": 1.76, "reason": "silence", "latency_ms": 131.0,
             "words": [{"word": "Hello", "start": 0.3, "end": 0.62}, {"word": "world", "start": 0.7, "end": 1.18}]}
    words = (Word("Hello", 0.3, 0.62), Word("world", 0.7, 1.18))
    for frame in (json.dumps(final), msgpack.packb(final)):
        parsed = parse_event(frame)
        assert parsed.words == words and parsed.words_reason is None
    none = parse_event(json.dumps({**final, "words": [], "words_reason": "the aligner does not support Arabic"}))
    assert none.words == () and none.words_reason == "the aligner does not support Arabic"
    plain = {key: value for key, value in final.items() if key != "words"}
    assert parse_event(json.dumps(plain)).words is None  # a stream that did not ask


@pytest.mark.parametrize("words, match", [
    ("Hello world", "list of"), ([["Hello", 0.3, 0.6]], "list of"), ([{"word": "Hello", "start": 0.3}], "end"),
    ([{"word": "Hello", "start": "soon", "end": 0.6}], "not what this client expects"),
])
def test_words_of_another_shape_are_protocol_mismatches(words, match):
    final = {"type": "final", "segment_id": 0, "text": "Hello", "language": "English", "start": 0.0, "end": 1.0,
             "reason": "silence", "latency_ms": 1.0, "words": words}
    with pytest.raises(ProtocolMismatch, match=match):
        parse_event(json.dumps(final))
