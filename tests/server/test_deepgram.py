"""The Deepgram live adapter, sans-I/O: query -> settings, client messages -> commands, session events -> frames.
Frames are checked against deepgram-sdk's own pydantic models, so a field the SDK requires cannot go missing."""

from __future__ import annotations

import datetime
import hashlib
import json

import numpy as np
import pytest
from deepgram.listen.v1.types import (
    ListenV1ConfigureFailure,
    ListenV1ConfigureSuccess,
    ListenV1Error,
    ListenV1Metadata,
    ListenV1Results,
    ListenV1SpeechStarted,
    ListenV1UtteranceEnd,
)

from qasr.server.commands import Audio, End, Flush, Reply, Start
from qasr.server.deepgram import DeepgramAdapter, estimated_words
from qasr.server.deepgram_options import ListenOptions, QueryError
from qasr.streaming import events
from qasr.streaming.settings import StreamLimits, StreamSettings

SDK_MODELS = {"Results": ListenV1Results, "Metadata": ListenV1Metadata, "SpeechStarted": ListenV1SpeechStarted,
              "UtteranceEnd": ListenV1UtteranceEnd, "Error": ListenV1Error,
              "ConfigureSuccess": ListenV1ConfigureSuccess, "ConfigureFailure": ListenV1ConfigureFailure}


def decoded(frames) -> list[dict]:
    """Frames -> payloads, each validated strictly by the SDK's model for its type."""
    payloads = [json.loads(frame) for frame in frames]
    for payload in payloads:
        SDK_MODELS[payload["type"]].model_validate(payload, strict=False)
    return payloads


def replies(commands) -> list[dict]:
    return decoded([frame for command in commands if isinstance(command, Reply) for frame in command.frames])


def adapter(query: str = "", **defaults) -> DeepgramAdapter:
    return DeepgramAdapter(query, defaults=StreamSettings(**defaults), limits=StreamLimits(),
                           now=datetime.datetime(2025, 1, 2, 3, 4, 5, 678000, tzinfo=datetime.timezone.utc))


def test_query_options_map_onto_stream_settings():
    dg = adapter("model=nova-3&encoding=mulaw&sample_rate=8000&channels=2&interim_results=TRUE&endpointing=10"
                 "&language=en-US&keyterm=Qwen&keyterm=soxr&keywords=qasr:2&punctuate=true&smart_format=true")
    settings = dg.settings
    assert (settings.encoding, settings.sample_rate, settings.channels) == ("mulaw", 8000, 2)
    assert settings.language == "English" and settings.partials
    assert settings.vad.end_silence_ms == 100  # Deepgram's 10 ms is below qasr's minimum: clamped
    assert settings.context == "Qwen, soxr, qasr"
    assert dg.options.model == "nova-3"


def test_defaults_endpointing_false_and_multi_language():
    options = ListenOptions.parse("model=x&endpointing=false&language=multi")
    settings = options.stream_settings(StreamSettings())
    assert (settings.encoding, settings.sample_rate, settings.language) == ("s16le", 16000, None)
    assert settings.vad.end_silence_ms == 5000 and not settings.partials
    assert ListenOptions.parse("encoding=alaw").stream_settings(StreamSettings()).sample_rate == 8000


@pytest.mark.parametrize("query", ["encoding=opus", "interim_results=maybe", "language=xx", "sample_rate=abc",
                                   "channels=99", "sample_rate=1000"])
def test_options_qasr_cannot_take_refuse_the_handshake(query):
    with pytest.raises(QueryError):
        adapter(query)


def test_audio_starts_the_stream_and_partial_frames_wait_for_the_rest():
    dg = adapter("encoding=linear16&sample_rate=16000&channels=2")
    data = np.array([0, 16384, -16384, 8192], dtype="<i2").tobytes()  # two stereo frames
    start, audio = dg.receive(data[:5])
    assert isinstance(start, Start) and start.settings.channels == 2
    assert audio.samples.shape == (1, 2)
    [rest] = dg.receive(data[5:])
    np.testing.assert_allclose(rest.samples, [[-0.5, 0.25]])
    [metadata] = decoded(dg.encode(events.Summary(0, 2 / 16000, 0.0)))
    assert metadata["sha256"] == hashlib.sha256(data).hexdigest()
    assert metadata["duration"] == round(2 / 16000, 3) and metadata["channels"] == 2
    assert metadata["created"] == "2025-01-02T03:04:05.678Z"


@pytest.mark.parametrize("buffer", [bytes, bytearray, memoryview])
def test_audio_in_any_buffer_is_decoded_and_a_frame_split_over_messages_is_whole_once(buffer):
    dg = adapter("encoding=linear16&sample_rate=16000&channels=2")
    data = np.array([0, 16384, -16384, 8192, 4096, -8192], dtype="<i2").tobytes()  # three stereo frames
    received = []
    for piece in (data[:3], data[3:9], data[9:]):  # less than a frame; the rest of it and half the next; the rest
        held = bytearray(piece)
        received += dg.receive(buffer(held))
        held[:] = bytes(len(held))  # the caller reusing its buffer changes nothing the adapter kept
    audio = np.concatenate([command.samples for command in received if isinstance(command, Audio)])
    np.testing.assert_allclose(audio, [[0.0, 0.5], [-0.5, 0.25], [0.125, -0.25]])
    [metadata] = decoded(dg.encode(events.Summary(0, 3 / 16000, 0.0)))
    assert metadata["sha256"] == hashlib.sha256(data).hexdigest()


def test_control_messages():
    dg = adapter()
    assert isinstance(dg.receive(json.dumps({"type": "KeepAlive"}))[0], Start)  # the first message starts it
    assert dg.receive(json.dumps({"type": "KeepAlive"})) == []
    assert dg.receive(json.dumps({"type": "Finalize"})) == [Flush()]
    assert dg.receive(json.dumps({"type": "CloseStream"})) == [End()]
    assert dg.receive(b"") == [End()]  # Deepgram's older close: an empty binary frame


def test_finalize_of_one_channel_needs_a_channel_of_the_stream():
    dg = adapter("channels=2&multichannel=false")
    dg.receive(json.dumps({"type": "KeepAlive"}))
    [error] = replies(dg.receive(json.dumps({"type": "Finalize", "channel": 1})))  # one mixed channel
    assert error["variant"] == "SchemaError"
    assert dg.receive(json.dumps({"type": "Finalize", "channel": 0})) == [Flush(channel=0)]


def test_configure_accepts_features_and_refuses_keyterms():
    dg = adapter()
    [success] = replies(dg.receive(json.dumps({"type": "Configure", "features": {"numerals": True}})))
    assert success["type"] == "ConfigureSuccess" and success["request_id"] == dg.request_id
    [failure] = replies(dg.receive(json.dumps({"type": "Configure", "keyterms": ["qasr"]})))
    assert failure["code"] == "CONFIGURE_KEYTERMS_NOT_SUPPORTED"


@pytest.mark.parametrize("message", ["{not json", json.dumps(["KeepAlive"]), json.dumps({"type": "Shout"})])
def test_bad_text_messages_are_deepgram_errors_and_the_stream_goes_on(message):
    dg = adapter()
    dg.receive(json.dumps({"type": "KeepAlive"}))
    [error] = replies(dg.receive(message))
    assert error["type"] == "Error" and error["variant"] == "SchemaError" and error["message"] == message


def test_interim_results_only_when_asked():
    partial = events.Partial(0, "hello wor", "English", 0.5, 1.5)
    assert adapter().encode(partial) == []
    [interim] = decoded(adapter("interim_results=true").encode(partial))
    assert interim["is_final"] is False and interim["channel"]["alternatives"][0]["transcript"] == "hello wor"
    assert (interim["start"], interim["duration"]) == (0.5, 1.0)


@pytest.mark.parametrize("reason, speech_final, from_finalize", [
    ("silence", True, False), ("flush", True, True), ("end", True, False), ("max_length", False, False)])
def test_finals_say_why_they_ended(reason, speech_final, from_finalize):
    [result] = decoded(adapter().encode(events.Final(3, "Hello there.", "English", 1.0, 2.0, reason, 5.0)))
    assert result["is_final"] is True
    assert (result["speech_final"], result["from_finalize"]) == (speech_final, from_finalize)
    assert result["channel_index"] == [0, 1]
    assert result["metadata"]["model_info"]["name"] == "qasr"


def test_vad_events_and_utterance_end_when_asked():
    dg = adapter("vad_events=true&interim_results=true&utterance_end_ms=1000")
    [started] = decoded(dg.encode(events.SpeechStarted(0, 1.25)))
    assert started == {"type": "SpeechStarted", "channel": [0, 1], "timestamp": 1.25}
    result, utterance_end = decoded(dg.encode(events.Final(0, "Hi.", "English", 1.25, 2.0, "silence", 5.0)))
    assert utterance_end == {"type": "UtteranceEnd", "channel": [0, 1], "last_word_end": 2.0}
    assert adapter().encode(events.SpeechStarted(0, 1.25)) == []


def test_session_errors_are_deepgram_errors():
    [error] = decoded(adapter().encode(events.Error("internal", "internal server error", fatal=True)))
    assert error == {"type": "Error", "variant": "internal", "description": "internal server error"}


def test_estimated_words_cover_the_segment_in_order_by_characters():
    words = estimated_words("Hello, big world!", 1.0, 2.5)
    assert [w["word"] for w in words] == ["hello", "big", "world"]
    assert [w["punctuated_word"] for w in words] == ["Hello,", "big", "world!"]
    assert words[0]["start"] == 1.0 and words[-1]["end"] == 2.5
    assert all(a["end"] == b["start"] for a, b in zip(words, words[1:]))
    assert words[0]["end"] - words[0]["start"] == pytest.approx(1.5 * 6 / 15, abs=1e-3)
    assert estimated_words("", 0.0, 1.0) == []


# -- word times from the forced aligner (#17) ------------------------------------------------------------------------

def test_on_a_server_with_an_aligner_every_stream_asks_for_words():
    assert adapter().settings.words is False
    with_aligner = DeepgramAdapter("", defaults=StreamSettings(), limits=StreamLimits(word_times=True))
    assert with_aligner.settings.words is True


def test_final_words_are_the_aligners_when_the_final_has_them():
    aligned = (events.Word("Hello", 1.12, 1.4), events.Word("there", 1.55, 1.9))
    final = events.Final(0, "Hello there.", "English", 1.0, 2.0, "silence", 5.0, words=aligned)
    result, utterance_end = decoded(adapter("utterance_end_ms=1000").encode(final))
    words = result["channel"]["alternatives"][0]["words"]
    assert [(w["word"], w["start"], w["end"], w["punctuated_word"]) for w in words] == [
        ("hello", 1.12, 1.4, "Hello"), ("there", 1.55, 1.9, "there.")]
    assert utterance_end["last_word_end"] == 1.9
    cjk = events.Final(0, "你好。", "Chinese", 0.0, 1.0, "silence", 5.0,
                       words=(events.Word("你", 0.1, 0.3), events.Word("好", 0.3, 0.6)))
    [result] = decoded(adapter().encode(cjk))
    assert [w["punctuated_word"] for w in result["channel"]["alternatives"][0]["words"]] == ["你", "好"]


def test_without_aligned_words_the_estimate_stays():
    for words in (None, ()):  # no aligner, or the aligner gave none (an unsupported language)
        final = events.Final(0, "Hello there.", "English", 1.0, 2.0, "silence", 5.0, words=words,
                             words_reason=None if words is None else "not supported")
        [result] = decoded(adapter().encode(final))
        assert result["channel"]["alternatives"][0]["words"] == estimated_words("Hello there.", 1.0, 2.0)
