"""The OpenAI Realtime transcription adapter, sans-I/O: client events in -> commands; session events in -> frames.
Frames are checked against the openai SDK's own pydantic models, so a field the SDK requires cannot go missing."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from openai.types.beta.realtime.transcription_session_updated_event import TranscriptionSessionUpdatedEvent
from openai.types.realtime import (
    ConversationItemInputAudioTranscriptionCompletedEvent,
    ConversationItemInputAudioTranscriptionDeltaEvent,
    ConversationItemInputAudioTranscriptionFailedEvent,
    InputAudioBufferClearedEvent,
    InputAudioBufferCommittedEvent,
    InputAudioBufferSpeechStartedEvent,
    InputAudioBufferSpeechStoppedEvent,
    RealtimeErrorEvent,
    SessionCreatedEvent,
    SessionUpdatedEvent,
)

from qasr.server.commands import Audio, Flush, Reply, Start
from qasr.server.errors import UnsupportedFormat
from qasr.server.openai_realtime import OpenAIRealtimeAdapter
from qasr.streaming import events
from qasr.streaming.settings import StreamLimits, StreamSettings

SDK_MODELS = {
    "session.created": SessionCreatedEvent, "session.updated": SessionUpdatedEvent,
    "transcription_session.updated": TranscriptionSessionUpdatedEvent, "error": RealtimeErrorEvent,
    "input_audio_buffer.cleared": InputAudioBufferClearedEvent,
    "input_audio_buffer.committed": InputAudioBufferCommittedEvent,
    "input_audio_buffer.speech_started": InputAudioBufferSpeechStartedEvent,
    "input_audio_buffer.speech_stopped": InputAudioBufferSpeechStoppedEvent,
    "conversation.item.input_audio_transcription.delta": ConversationItemInputAudioTranscriptionDeltaEvent,
    "conversation.item.input_audio_transcription.completed": ConversationItemInputAudioTranscriptionCompletedEvent,
    "conversation.item.input_audio_transcription.failed": ConversationItemInputAudioTranscriptionFailedEvent,
}


def decoded(frames) -> list[dict]:
    """Frames -> payloads, each validated by the SDK's model for its type (strict: required fields present)."""
    payloads = [json.loads(frame) for frame in frames]
    for payload in payloads:
        SDK_MODELS[payload["type"]].model_validate(payload)
        assert payload["event_id"].startswith("event_")
    return payloads


def replies(commands) -> list[dict]:
    return decoded([frame for command in commands if isinstance(command, Reply) for frame in command.frames])


def adapter(**defaults) -> OpenAIRealtimeAdapter:
    return OpenAIRealtimeAdapter(defaults=StreamSettings(**defaults), limits=StreamLimits(), model_name="qwen3-asr")


def send(adapter: OpenAIRealtimeAdapter, **event) -> list:
    return adapter.receive(json.dumps(event))


def append(adapter: OpenAIRealtimeAdapter, data: bytes) -> list:
    return send(adapter, type="input_audio_buffer.append", audio=base64.b64encode(data).decode())


def pcm(seconds: float, rate: int = 24000) -> bytes:
    return (np.full(int(seconds * rate), 1000, dtype="<i2")).tobytes()


def test_greeting_is_a_ga_transcription_session():
    [created] = decoded(adapter().greeting())
    session = created["session"]
    assert created["type"] == "session.created"
    assert session["type"] == "transcription" and session["id"].startswith("sess_")
    assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert session["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert session["audio"]["input"]["transcription"]["model"] == "qwen3-asr"


def test_ga_session_update_maps_onto_stream_settings_and_is_echoed():
    realtime = adapter()
    commands = send(realtime, type="session.update", session={
        "type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcmu"},
            "transcription": {"model": "gpt-4o-transcribe", "language": "en", "prompt": "A call about qasr.",
                              "keywords": ["Qwen", "soxr"]},
            "turn_detection": {"type": "server_vad", "threshold": 0.9, "prefix_padding_ms": 200,
                               "silence_duration_ms": 50},
            "noise_reduction": {"type": "near_field"}}}})
    [updated] = replies(commands)
    assert updated["type"] == "session.updated"
    assert updated["session"]["audio"]["input"]["transcription"]["language"] == "en"
    assert updated["session"]["audio"]["input"]["noise_reduction"] == {"type": "near_field"}
    settings = realtime.settings
    assert (settings.sample_rate, settings.encoding, settings.language) == (8000, "mulaw", "English")
    assert settings.context == "A call about qasr.\nQwen, soxr"
    assert (settings.vad.aggressiveness, settings.vad.pre_roll_ms, settings.vad.end_silence_ms) == (3, 200, 100)


def test_beta_transcription_session_update_is_answered_in_the_beta_shape():
    realtime = adapter()
    commands = send(realtime, type="transcription_session.update", session={
        "input_audio_format": "g711_alaw", "input_audio_transcription": {"model": "whisper-1", "language": "de"},
        "turn_detection": None})
    [updated] = replies(commands)
    assert updated["type"] == "transcription_session.updated"
    assert updated["session"]["input_audio_format"] == "g711_alaw"
    assert updated["session"]["turn_detection"] is None
    assert (realtime.settings.encoding, realtime.settings.sample_rate, realtime.settings.language) == \
           ("alaw", 8000, "German")
    assert realtime.config.manual_turns


@pytest.mark.parametrize("session, param", [
    ({"type": "realtime"}, "session.type"),
    ({"type": "transcription", "audio": {"input": {"format": {"type": "audio/opus"}}}},
     "session.audio.input.format.type"),
    ({"type": "transcription", "audio": {"input": {"transcription": {"language": "xx"}}}},
     "session.audio.input.transcription.language"),
    ({"type": "transcription", "audio": {"input": {"turn_detection": {"type": "push"}}}},
     "session.audio.input.turn_detection.type"),
    ({"type": "transcription", "audio": {"input": {"transcription": {"prompt": "x" * 5000}}}}, "session.context"),
])
def test_a_bad_session_update_is_an_error_naming_the_field_and_changes_nothing(session, param):
    realtime = adapter()
    before = realtime.settings
    [error] = replies(send(realtime, type="session.update", event_id="client-1", session=session))
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param and error["error"]["event_id"] == "client-1"
    assert realtime.settings == before


def test_first_append_starts_the_stream_and_odd_bytes_wait_for_the_next_append():
    realtime = adapter()
    samples = np.array([0, 16384, -16384], dtype="<i2").tobytes()
    start, audio = append(realtime, samples[:5])
    assert isinstance(start, Start) and start.settings.sample_rate == 24000
    assert isinstance(audio, Audio) and audio.samples.shape == (2, 1)
    [rest] = append(realtime, samples[5:])
    np.testing.assert_allclose(rest.samples[:, 0], [-0.5])


def test_an_append_shorter_than_a_sample_starts_nothing_until_the_sample_is_whole():
    realtime = adapter()
    samples = np.array([16384, -16384], dtype="<i2").tobytes()
    assert append(realtime, samples[:1]) == []
    start, first = append(realtime, samples[1:3])  # completes the first sample, begins the second
    assert isinstance(start, Start)
    np.testing.assert_allclose(first.samples[:, 0], [0.5])
    [second] = append(realtime, samples[3:])
    np.testing.assert_allclose(second.samples[:, 0], [-0.5])


def test_every_server_event_has_an_id_of_its_own_across_sessions():
    ids = []
    for realtime in (adapter(), adapter()):
        frames = realtime.greeting()
        for command in [*send(realtime, type="session.update", session={"type": "transcription"}),
                        *append(realtime, pcm(0.2))]:
            frames += command.frames if isinstance(command, Reply) else []
        frames += realtime.encode(events.SpeechStarted(0, 0.0))
        frames += realtime.encode(events.Final(0, "hello there", "English", 0.0, 0.2, "silence", 5.0))
        ids += [payload["event_id"] for payload in decoded(frames)]
    assert len(ids) == 12 and len(set(ids)) == len(ids)
    assert all(len(event_id) == len("event_") + 22 for event_id in ids)  # the shape event ids always had


def test_commit_needs_100_ms_of_new_audio():
    realtime = adapter()
    [error] = replies(send(realtime, type="input_audio_buffer.commit", event_id="e1"))
    assert error["error"]["code"] == "input_audio_buffer_commit_empty" and error["error"]["event_id"] == "e1"
    append(realtime, pcm(0.05))
    assert replies(send(realtime, type="input_audio_buffer.commit"))[0]["type"] == "error"
    append(realtime, pcm(0.06))
    assert send(realtime, type="input_audio_buffer.commit") == [Flush()]
    assert replies(send(realtime, type="input_audio_buffer.commit"))[0]["type"] == "error"


def test_clear_flushes_a_started_stream_and_is_answered_cleared():
    realtime = adapter()
    [reply] = send(realtime, type="input_audio_buffer.clear")  # nothing started: nothing to flush
    assert replies([reply])[0]["type"] == "input_audio_buffer.cleared"
    append(realtime, pcm(0.5))
    flush, reply = send(realtime, type="input_audio_buffer.clear")
    assert flush == Flush() and replies([reply])[0]["type"] == "input_audio_buffer.cleared"


@pytest.mark.parametrize("message, code", [
    ("not json", "invalid_json"),
    (json.dumps([1, 2]), "invalid_event"),
    (json.dumps({"type": "response.create"}), "invalid_event"),
    (json.dumps({"type": "no.such.event"}), "invalid_event"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}), "invalid_value"),
    (json.dumps({"type": "input_audio_buffer.append"}), "invalid_value"),
    (b"\x00\x01", "invalid_message"),
])
def test_malformed_and_unsupported_events_are_error_events(message, code):
    [error] = replies(adapter().receive(message))
    assert error["error"]["code"] == code


def test_an_update_after_audio_may_repeat_the_settings_but_not_change_them():
    realtime = adapter()
    append(realtime, pcm(0.2))
    same = {"type": "transcription", "audio": {"input": {"transcription": {"model": "other-model"}}}}
    assert replies(send(realtime, type="session.update", session=same))[0]["type"] == "session.updated"
    changed = {"type": "transcription", "audio": {"input": {"transcription": {"language": "fr"}}}}
    [error] = replies(send(realtime, type="session.update", session=changed))
    assert error["error"]["code"] == "session_already_started"
    assert realtime.settings.language is None


def encode_all(realtime, session_events) -> list[dict]:
    return decoded([frame for event in session_events for frame in realtime.encode(event)])


def test_server_vad_turns_become_items_chained_by_previous_item_id():
    realtime = adapter()
    sent = encode_all(realtime, [
        events.Ready("s", "m", 24000, 16000), events.SpeechStarted(0, 0.25),
        events.Partial(0, "hello wor", "English", 0.25, 1.25),
        events.Partial(0, "hello world how", "English", 0.25, 2.25),
        events.SpeechEnded(0, 3.0), events.Final(0, "Hello world, how are you?", "English", 0.25, 3.0, "silence", 5.0),
        events.SpeechStarted(1, 4.0), events.SpeechEnded(1, 5.5),
        events.Final(1, "Fine.", "English", 4.0, 5.5, "silence", 5.0), events.Summary(2, 6.0, 2.75)])
    assert [payload["type"] for payload in sent] == [
        "input_audio_buffer.speech_started", "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.delta", "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed", "conversation.item.input_audio_transcription.completed",
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
        "conversation.item.input_audio_transcription.completed"]
    first, second = sent[0]["item_id"], sent[6]["item_id"]
    assert first != second and all(p["item_id"] == first for p in sent[:6])
    assert sent[0]["audio_start_ms"] == 250 and sent[3]["audio_end_ms"] == 3000
    assert [sent[1]["delta"], sent[2]["delta"]] == ["hello ", "world "]  # the last word waits for confirmation
    assert sent[4]["previous_item_id"] is None and sent[8]["previous_item_id"] == first
    assert sent[5]["transcript"] == "Hello world, how are you?"
    assert sent[5]["usage"] == {"type": "duration", "seconds": 2.75}


def test_deltas_stay_append_only_when_a_partial_revises_sent_text():
    realtime = adapter()
    sent = encode_all(realtime, [
        events.SpeechStarted(0, 0.0), events.Partial(0, "the cat sat", "English", 0.0, 1.0),
        events.Partial(0, "a cat sat on the", "English", 0.0, 2.0),  # revises "the": nothing to append
        events.Partial(0, "the cat sat on the mat", "English", 0.0, 3.0),
        events.Final(0, "A cat sat on the mat.", "English", 0.0, 3.5, "silence", 1.0)])
    deltas = [p["delta"] for p in sent if p["type"].endswith(".delta")]
    assert deltas == ["the cat ", "sat on the "]
    assert sent[-1]["transcript"] == "A cat sat on the mat."  # completed is the truth


def test_a_failed_decode_is_a_failed_event_for_its_item():
    realtime = adapter()
    sent = encode_all(realtime, [
        events.SpeechStarted(0, 0.0), events.Error("decode_failed", "segment 0 could not be transcribed"),
        events.Final(0, "", "", 0.0, 1.0, "silence", 1.0)])
    assert sent[-1]["type"] == "conversation.item.input_audio_transcription.failed"
    assert sent[-1]["item_id"] == sent[0]["item_id"]


def test_session_errors_use_openai_error_objects():
    [error] = encode_all(adapter(), [events.Error("internal", "internal server error", fatal=True)])
    assert error["error"] == {"type": "server_error", "code": "internal", "message": "internal server error",
                              "param": None, "event_id": None}


def manual(realtime: OpenAIRealtimeAdapter) -> OpenAIRealtimeAdapter:
    send(realtime, type="session.update", session={"type": "transcription",
                                                   "audio": {"input": {"turn_detection": None}}})
    return realtime


def test_manual_turns_send_no_vad_events_and_commit_per_segment():
    realtime = manual(adapter())
    assert realtime.settings.vad.end_silence_ms == 5000  # a pause inside a turn does not split it
    sent = encode_all(realtime, [events.SpeechStarted(0, 0.1), events.SpeechEnded(0, 2.0),
                                 events.Final(0, "one turn", "English", 0.1, 2.0, "flush", 1.0)])
    assert [p["type"] for p in sent] == ["input_audio_buffer.committed",
                                         "conversation.item.input_audio_transcription.completed"]


def test_clear_with_server_vad_drops_only_the_segment_its_flush_closed():
    realtime = adapter()
    append(realtime, pcm(2.0))
    send(realtime, type="input_audio_buffer.clear")
    sent = encode_all(realtime, [
        events.SpeechStarted(0, 0.1), events.SpeechEnded(0, 1.0),
        events.Final(0, "kept", "English", 0.1, 1.0, "silence", 1.0),
        events.SpeechStarted(1, 1.3), events.SpeechEnded(1, 2.0),
        events.Final(1, "dropped", "English", 1.3, 2.0, "flush", 1.0)])
    assert [p.get("transcript") for p in sent if p["type"].endswith("completed")] == ["kept"]
    assert sum(p["type"] == "input_audio_buffer.committed" for p in sent) == 1


def test_clear_with_manual_turns_drops_everything_since_the_last_commit():
    realtime = manual(adapter())
    append(realtime, pcm(1.0))
    send(realtime, type="input_audio_buffer.commit")
    append(realtime, pcm(8.0))
    send(realtime, type="input_audio_buffer.clear")
    sent = encode_all(realtime, [
        events.SpeechStarted(0, 0.1), events.Final(0, "committed turn", "English", 0.1, 1.0, "flush", 1.0),
        events.SpeechStarted(1, 1.2), events.Final(1, "first part", "English", 1.2, 3.0, "silence", 1.0),
        events.SpeechStarted(2, 8.5), events.Final(2, "second part", "English", 8.5, 9.0, "flush", 1.0),
        events.SpeechStarted(3, 9.5), events.Final(3, "after the clear", "English", 9.5, 10.0, "flush", 1.0)])
    assert [p["transcript"] for p in sent if p["type"].endswith("completed")] == ["committed turn",
                                                                                  "after the clear"]


def test_only_transcription_sessions_are_served():
    options = {"defaults": StreamSettings(), "limits": StreamLimits(), "model_name": "qwen3-asr"}
    adapter = OpenAIRealtimeAdapter.for_query("model=gpt-4o-transcribe&intent=transcription", **options)
    assert decoded(adapter.greeting())[0]["session"]["type"] == "transcription"
    for query in ("", "model=gpt-realtime", "intent=conversation"):
        with pytest.raises(UnsupportedFormat, match="intent=transcription"):  # the handshake is refused (400)
            OpenAIRealtimeAdapter.for_query(query, **options)
