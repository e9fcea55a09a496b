"""Genesys AudioHook without sockets: the whole lifecycle, media selection, the probe, sequence checks, transcripts
back as `event` messages, and each violation answered the protocol's way."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from call_replay import AudioHookClient

from qasr.server import errors
from qasr.server.audiohook import PROBE_CONVERSATION, AudioHookAdapter, State, choose_media, duration
from qasr.server.calls import CallRegistry
from qasr.server.commands import Audio, End, Flush, Notice, Reply, Start
from qasr.streaming import events
from qasr.streaming.settings import StreamLimits, StreamSettings

SILENCE = np.zeros(160, np.float32)


def adapter(client: AudioHookClient, registry: CallRegistry | None = None) -> AudioHookAdapter:
    return AudioHookAdapter(defaults=StreamSettings(), limits=StreamLimits(),
                            calls=registry if registry is not None else CallRegistry(), headers=client.headers)


def replies(commands) -> list[dict]:
    return [json.loads(frame) for command in commands if isinstance(command, Reply) for frame in command.frames]


def parse_all(frames) -> list[dict]:
    return [json.loads(frame) for frame in frames]


def opened(client: AudioHookClient, registry=None, **open_parameters):
    hook = adapter(client, registry)
    commands = hook.receive(client.open(**open_parameters))
    for message in replies(commands):
        client.saw(json.dumps(message))
    return hook, commands


def test_the_full_lifecycle_open_audio_ping_update_pause_resume_close():
    client = AudioHookClient()
    registry = CallRegistry()
    hook, commands = opened(client, registry, language="en-US")
    start = commands[0]
    assert isinstance(start, Start)
    assert (start.settings.sample_rate, start.settings.encoding, start.settings.channels,
            start.settings.multichannel, start.settings.language) == (8000, "mulaw", 2, True, "English")
    [opened_message] = replies(commands)
    assert opened_message["type"] == "opened" and opened_message["seq"] == 1 and opened_message["clientseq"] == 1
    assert opened_message["id"] == client.session_id
    assert opened_message["parameters"]["media"] == [{"type": "audio", "format": "PCMU",
                                                      "channels": ["external", "internal"], "rate": 8000}]
    [audio] = hook.receive(client.audio(SILENCE + 0.1, SILENCE - 0.1))
    assert isinstance(audio, Audio) and audio.samples.shape == (160, 2)
    assert audio.samples[0, 0] > 0 > audio.samples[0, 1]  # external on channel 0, internal on 1
    assert hook.position == "PT0.02S"
    [pong] = replies(hook.receive(client.message("ping", {"rtt": "PT0.05S"})))
    assert (pong["type"], pong["seq"], pong["clientseq"]) == ("pong", 2, 2)  # binary frames carry no seq
    [updated] = replies(hook.receive(client.message("update", {"language": "de-DE"})))
    assert updated["type"] == "updated"
    assert hook.receive(client.message("paused")) == [Flush()]
    with pytest.raises(errors.MalformedMessage, match="Received audio in state PAUSED"):
        hook.receive(client.audio(SILENCE, SILENCE))
    assert hook.receive(client.message("resumed", {"start": "PT0.02S", "discarded": "PT1S"})) == []
    assert hook.state is State.ACTIVE
    assert hook.receive(client.message("close", {"reason": "end"})) == [End()]
    final = events.Final(0, "hello", "English", 0.5, 1.25, "end", 3.0)
    [event] = parse_all(hook.encode(final))
    [closed] = parse_all(hook.encode(events.Summary(1, 1.0, 0.75)))
    assert (event["type"], closed["type"]) == ("event", "closed")
    assert closed["seq"] == event["seq"] + 1
    hook.close()
    call = list(registry.get(client.conversation_id)._replay)
    assert [m["type"] for m in call] == ["call_started", "final", "call_ended"]
    assert call[1]["speaker"] == "caller" and call[-1]["reason"] == "end"


def test_transcripts_are_transcript_entities_partials_then_the_final_under_one_id():
    client = AudioHookClient()
    hook, _ = opened(client)
    partial = events.Partial(3, "hel", "English", 1.0, 1.5)
    final = events.Final(3, "hello", "English", 1.0, 2.25, "silence", 3.0)
    object.__setattr__(final, "channel", 1)
    object.__setattr__(partial, "channel", 1)
    [first] = parse_all(hook.encode(partial))
    [second] = parse_all(hook.encode(final))
    entity = second["parameters"]["entities"][0]
    assert entity == {"type": "transcript", "data": {
        "id": entity["data"]["id"], "channelId": 1, "isFinal": True, "offset": "PT1S", "duration": "PT1.25S",
        "alternatives": [{"confidence": 1.0, "interpretations": [{"type": "display", "transcript": "hello"}]}]}}
    assert first["parameters"]["entities"][0]["data"]["isFinal"] is False
    assert first["parameters"]["entities"][0]["data"]["id"] == entity["data"]["id"]
    assert re.fullmatch(r"[0-9a-f-]{36}", entity["data"]["id"])
    assert hook.encode(events.Final(4, "  ", "", 3.0, 3.5, "silence", 1.0)) == []  # nothing heard: no event
    assert hook.encode(events.SpeechStarted(5, 4.0)) == []


def test_a_finals_words_become_its_transcript_tokens_on_a_server_that_times_words():
    client = AudioHookClient()
    hook = AudioHookAdapter(defaults=StreamSettings(), limits=StreamLimits(word_times=True), calls=CallRegistry(),
                            headers=client.headers)
    start = hook.receive(client.open())[0]
    assert isinstance(start, Start) and start.settings.words is True  # asked wherever the aligner is loaded
    final = events.Final(0, "Hello, world.", "English", 1.0, 2.5, "silence", 3.0,
                         words=(events.Word("Hello", 1.2, 1.52), events.Word("world", 1.6, 2.08)))
    [message] = parse_all(hook.encode(final))
    [interpretation] = message["parameters"]["entities"][0]["data"]["alternatives"][0]["interpretations"]
    assert interpretation == {"type": "display", "transcript": "Hello, world.", "tokens": [
        {"type": "word", "value": "Hello", "confidence": 1.0, "offset": "PT1.2S", "duration": "PT0.32S"},
        {"type": "word", "value": "world", "confidence": 1.0, "offset": "PT1.6S", "duration": "PT0.48S"}]}
    unaligned = events.Final(1, "marhaba", "Arabic", 3.0, 4.0, "silence", 3.0, words=(), words_reason="unsupported")
    [message] = parse_all(hook.encode(unaligned))
    assert "tokens" not in message["parameters"]["entities"][0]["data"]["alternatives"][0]["interpretations"][0]
    other = AudioHookClient()
    assert adapter(other).receive(other.open())[0].settings.words is False  # no aligner: not asked


def test_the_probe_is_opened_and_closed_without_transcribing_or_publishing():
    client = AudioHookClient(conversation_id=PROBE_CONVERSATION)
    registry = CallRegistry()
    hook, commands = opened(client, registry)
    assert isinstance(commands[0], Start) and replies(commands)[0]["type"] == "opened"
    assert hook.receive(client.audio(SILENCE, SILENCE)) == []
    assert hook.receive(client.message("close", {"reason": "end"})) == [End()]
    [closed] = parse_all(hook.encode(events.Summary(0, 0.02, 0.0)))
    assert closed["type"] == "closed"
    hook.close()
    assert len(registry) == 0


def test_a_mono_offer_is_taken_when_no_stereo_one_is_usable():
    assert choose_media([{"type": "audio", "format": "opus", "channels": ["external", "internal"], "rate": 8000},
                         {"type": "audio", "format": "L16", "channels": ["internal"], "rate": 8000}]) == \
        {"type": "audio", "format": "L16", "channels": ["internal"], "rate": 8000}
    assert choose_media([{"type": "audio", "format": "PCMU", "channels": ["external"], "rate": 16000}]) is None
    client = AudioHookClient()
    hook, commands = opened(client, channels=("external",), media_format="L16")
    assert (commands[0].settings.channels, commands[0].settings.encoding) == (1, "s16le")  # the first mono offer


def test_no_usable_media_is_answered_with_disconnect():
    client = AudioHookClient()
    hook = adapter(client)
    message = json.loads(client.open())
    for offer in message["parameters"]["media"]:
        offer["rate"] = 44100
    with pytest.raises(errors.UnsupportedFormat) as raised:
        hook.receive(json.dumps(message))
    [disconnect] = parse_all(hook.encode(events.Error(raised.value.error_code, str(raised.value), fatal=True)))
    assert disconnect["type"] == "disconnect" and disconnect["parameters"]["reason"] == "error"
    assert disconnect["parameters"]["info"].startswith("Client Error: no supported media")


def test_a_sequence_number_violation_is_answered_with_the_protocols_error():
    client = AudioHookClient()
    hook, _ = opened(client)
    client.seq += 1  # one message lost
    with pytest.raises(errors.MalformedMessage, match="Invalid seq value") as raised:
        hook.receive(client.message("ping"))
    error = events.Error(raised.value.error_code, str(raised.value), fatal=True)
    [disconnect] = parse_all(hook.encode(error))
    assert disconnect["type"] == "disconnect" and disconnect["seq"] == 2
    assert disconnect["parameters"]["reason"] == "error"
    assert "Invalid seq value" in disconnect["parameters"]["info"]
    assert hook.encode(events.Final(0, "late", "English", 0, 1, "end", 1.0)) == []  # nothing after disconnect
    assert hook.receive(client.message("ping")) == []


@pytest.mark.parametrize("override, match", [
    ({"serverseq": 5}, "Invalid serverseq"),
    ({"id": "5d1b4ab4-1f0a-4b43-a7b6-0d1f4b0c0f6e"}, "Session identifier mismatch"),
    ({"version": "1"}, "well-formed"),
    ({"position": "12s"}, "well-formed"),
    ({"type": "dance"}, "not a supported client message"),
])
def test_malformed_messages_are_client_errors(override, match):
    client = AudioHookClient()
    hook, _ = opened(client)
    with pytest.raises(errors.MalformedMessage, match=match):
        hook.receive(client.message("ping", **override))


def test_audio_before_open_and_bad_frames_are_client_errors():
    client = AudioHookClient()
    with pytest.raises(errors.MalformedMessage, match="state PREPARING"):
        adapter(client).receive(b"\xff" * 320)
    hook, _ = opened(client)
    with pytest.raises(errors.MalformedMessage, match="not a valid audio frame"):
        hook.receive(b"\xff" * 3)  # not whole stereo samples
    with pytest.raises(errors.MalformedMessage, match="not valid JSON"):
        hook.receive("{")


def test_a_client_error_message_becomes_a_notice_and_close_before_open_is_closed_at_once():
    client = AudioHookClient()
    hook, _ = opened(client)
    [notice] = hook.receive(client.message("error", {"code": 500, "message": "oops"}))
    assert isinstance(notice, Notice) and "oops" in notice.message
    other = AudioHookClient()
    early = adapter(other)
    [closed] = replies(early.receive(other.message("close", {"reason": "end"})))
    assert closed["type"] == "closed"


def test_shutdown_is_a_server_error_disconnect():
    client = AudioHookClient()
    hook, _ = opened(client)
    [disconnect] = parse_all(hook.encode(events.Error("going_away", "server is shutting down", fatal=True)))
    assert disconnect["parameters"] == {"reason": "error", "info": "Server error: server is shutting down"}


@pytest.mark.parametrize("seconds, text", [(0, "PT0S"), (1.5, "PT1.5S"), (12.3456, "PT12.346S"), (-1, "PT0S")])
def test_durations(seconds, text):
    assert duration(seconds) == text
