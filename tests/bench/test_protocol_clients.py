"""The stream bench's wire clients, without sockets: what each would send goes through the server's own adapter for
its protocol (it must be accepted as the audio it is), and what the adapter sends back is read into native events."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qasr.audio import decode_pcm
from qasr.bench import protocol_clients as clients
from qasr.server.calls import CallRegistry
from qasr.server.deepgram import DeepgramAdapter
from qasr.server.commands import Audio, End, Flush, Reply, Start
from qasr.server.openai_realtime import OpenAIRealtimeAdapter
from qasr.server.twilio import TwilioAdapter
from qasr.streaming import events
from qasr.streaming.settings import StreamLimits, StreamSettings


def tone(frequency: float, seconds: float, rate: int) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * frequency * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def test_a_url_without_a_path_gets_the_protocols_path_and_a_full_one_is_kept():
    assert clients.endpoint("ws://h:1", "native") == "ws://h:1/v1/stream"
    assert clients.endpoint("ws://h:1/", "openai") == "ws://h:1/v1/realtime?intent=transcription"
    assert clients.endpoint("wss://h:1", "twilio") == "wss://h:1/v1/twilio"
    assert clients.endpoint("ws://h:1", "deepgram") == f"ws://h:1/v1/listen?{clients.DEEPGRAM_QUERY}"
    assert clients.endpoint("ws://h:1/custom/path?x=1", "openai") == "ws://h:1/custom/path?x=1"
    assert clients.subscriber_url("ws://h:1", "CA12") == "ws://h:1/v1/calls/CA12/events"
    with pytest.raises(ValueError, match="ws://"):
        clients.endpoint("http://h:1", "native")


# ---- OpenAI Realtime ---------------------------------------------------------------------------------------------


def openai_adapter() -> OpenAIRealtimeAdapter:
    return OpenAIRealtimeAdapter(defaults=StreamSettings(), limits=StreamLimits(), model_name="qwen3-asr")


def test_the_openai_client_configures_24khz_pcm_with_server_vad_and_its_appends_are_the_audio():
    adapter = openai_adapter()
    [reply] = adapter.receive(clients.openai_session_update("en"))
    [updated] = [json.loads(frame) for frame in reply.frames]
    assert updated["type"] == "session.updated"
    audio_input = updated["session"]["audio"]["input"]
    assert audio_input["format"] == {"type": "audio/pcm", "rate": 24000}
    assert audio_input["turn_detection"]["type"] == "server_vad"
    assert audio_input["transcription"]["language"] == "en"

    signal = tone(300, 0.25, clients.OPENAI_RATE)
    commands = adapter.receive(clients.openai_append(clients.pcm16(signal[:2400])))
    commands += adapter.receive(clients.openai_append(clients.pcm16(signal[2400:])))
    start, first, second = commands
    assert isinstance(start, Start) and (start.settings.sample_rate, start.settings.encoding) == (24000, "s16le")
    assert start.settings.language == "English" and start.settings.vad.pre_roll_ms == 300
    assert start.settings.vad.end_silence_ms == 500 and start.settings.vad.aggressiveness == 2  # as native's
    received = np.concatenate([first.samples[:, 0], second.samples[:, 0]])
    np.testing.assert_allclose(received, signal, atol=1.5 / 32768)

    assert adapter.receive(clients.OPENAI_COMMIT) == [Flush()]  # server VAD too: the open turn ends
    [sync] = adapter.receive(clients.OPENAI_SYNC)  # accepted mid-stream: it changes nothing
    assert isinstance(sync, Reply) and json.loads(sync.frames[0])["type"] == "session.updated"


def test_the_openai_clients_reading_of_an_item_gives_native_events_and_the_items_latency():
    adapter = openai_adapter()
    adapter.receive(clients.openai_session_update(None))
    transcripts = clients.OpenAITranscripts()
    session_events = [
        (1.0, events.SpeechStarted(0, 0.5)),
        (1.5, events.Partial(0, "the quick brown", "English", 0.5, 1.5)),
        (2.0, events.Partial(0, "the quick brown fox jumps", "English", 0.5, 2.0)),
        (3.0, events.SpeechEnded(0, 2.8)),
        (3.25, events.Final(0, "the quick brown fox jumps over", "English", 0.5, 2.8, "silence", 9.0)),
    ]
    native = []
    for arrived, event in session_events:
        for frame in adapter.encode(event):
            taken = transcripts.take(arrived, json.loads(frame))
            native += [] if taken is None else [taken]
    kinds = [event["type"] for event in native]
    assert kinds == ["speech_started", "partial", "partial", "final"]
    assert native[0] == {"type": "speech_started", "segment_id": 0, "start": 0.5}
    assert [event["text"] for event in native[1:3]] == ["the quick ", "brown fox "]  # append-only deltas
    final = native[3]
    assert final["segment_id"] == 0 and final["text"] == "the quick brown fox jumps over" and final["end"] == 2.8
    assert final["latency_ms"] == pytest.approx(250.0)  # speech_stopped (3.0) -> completed (3.25)
    assert not transcripts.pending and transcripts.deltas == 2


def test_an_openai_item_that_failed_or_an_error_event_is_an_error_and_the_item_no_longer_pending():
    transcripts = clients.OpenAITranscripts()
    transcripts.take(1.0, {"type": "input_audio_buffer.speech_started", "item_id": "item_1", "audio_start_ms": 0})
    assert transcripts.pending == {"item_1"}
    failed = transcripts.take(2.0, {"type": "conversation.item.input_audio_transcription.failed",
                                    "item_id": "item_1", "error": {"code": "transcription_failed"}})
    assert failed["type"] == "error" and failed["segment_id"] == 0 and not transcripts.pending
    error = transcripts.take(2.0, {"type": "error", "error": {"code": "invalid_value", "message": "bad"}})
    assert error == {"type": "error", "code": "invalid_value", "message": "bad"}


# ---- Deepgram ----------------------------------------------------------------------------------------------------


def deepgram_adapter() -> DeepgramAdapter:
    return DeepgramAdapter(clients.DEEPGRAM_QUERY, defaults=StreamSettings(), limits=StreamLimits())


def test_the_deepgram_client_asks_for_24khz_linear16_with_interims_and_vad_events_and_its_frames_are_the_audio():
    adapter = deepgram_adapter()
    signal = tone(300, 0.25, clients.DEEPGRAM_RATE)
    start, first = adapter.receive(clients.pcm16(signal[:2400]))
    [second] = adapter.receive(clients.pcm16(signal[2400:]))
    settings = start.settings
    assert (settings.sample_rate, settings.encoding, settings.channels) == (24000, "s16le", 1)
    assert settings.partials and adapter.options.vad_events and adapter.options.utterance_end_ms == 1000
    received = np.concatenate([first.samples[:, 0], second.samples[:, 0]])
    np.testing.assert_allclose(received, signal, atol=1.5 / 32768)
    assert adapter.receive(clients.DEEPGRAM_CLOSE) == [End()]


def test_the_deepgram_clients_reading_numbers_segments_by_speech_started_and_finals_in_order():
    adapter = deepgram_adapter()
    adapter.receive(clients.pcm16(tone(300, 0.1, clients.DEEPGRAM_RATE)))
    transcripts = clients.DeepgramTranscripts()
    session_events = [
        events.SpeechStarted(0, 0.5), events.Partial(0, "the quick", "English", 0.5, 1.5),
        events.SpeechStarted(1, 3.0),  # the next segment begins before the first one's final arrives
        events.Final(0, "the quick brown", "English", 0.5, 2.8, "silence", 9.0),
        events.Partial(1, "fox", "English", 3.0, 4.0),
        events.Final(1, "fox jumps", "English", 3.0, 4.5, "end", 9.0), events.Summary(2, 4.5, 0.0),
    ]
    native = []
    for event in session_events:
        for frame in adapter.encode(event):
            taken = transcripts.take(json.loads(frame))
            native += [] if taken is None else [taken]
    assert [(event["type"], event["segment_id"]) for event in native] == [
        ("speech_started", 0), ("partial", 0), ("speech_started", 1), ("final", 0), ("partial", 1), ("final", 1)]
    assert native[3]["text"] == "the quick brown" and native[3]["end"] == pytest.approx(2.8)
    assert native[1]["end"] == pytest.approx(1.5) and native[0]["start"] == 0.5
    assert transcripts.ended  # Metadata came
    error = transcripts.take({"type": "Error", "variant": "DATA-0000", "description": "bad audio"})
    assert error == {"type": "error", "code": "DATA-0000", "message": "bad audio"}


# ---- Twilio ------------------------------------------------------------------------------------------------------


def test_a_twilio_call_is_accepted_by_the_twilio_adapter_as_its_two_tracks_audio():
    caller, agent = tone(300, 0.1, 8000), tone(700, 0.1, 8000)
    call = clients.TwilioCall([caller, agent], call_sid="CA1", parameters={"qasr_language": "en"})
    registry = CallRegistry()
    adapter = TwilioAdapter(defaults=StreamSettings(), limits=StreamLimits(), calls=registry)
    commands = adapter.receive(call.connected()) + adapter.receive(call.start())
    for frame in range(call.num_frames):
        for message in call.media(frame):
            commands += adapter.receive(message)
    commands += adapter.receive(call.stop())
    start, *audio, end = commands
    assert isinstance(start, Start) and isinstance(end, End) and all(isinstance(a, Audio) for a in audio)
    settings = start.settings
    assert (settings.sample_rate, settings.encoding, settings.channels, settings.multichannel) == (8000, "mulaw", 2,
                                                                                                   True)
    assert settings.language == "English"
    received = np.concatenate([a.samples for a in audio])
    assert received.shape == (len(caller), 2) and call.num_frames == 5
    for channel, sent in enumerate((caller, agent)):
        np.testing.assert_allclose(received[:, channel], sent, atol=0.3 * 2 ** -5)
    assert registry.get("CA1").started


def test_a_one_track_twilio_call_names_the_inbound_track_only():
    call = clients.TwilioCall([tone(300, 0.05, 8000)])
    start = json.loads(call.start())
    assert call.call_sid.startswith("CA") and start["start"]["tracks"] == ["inbound"]
    assert [json.loads(message)["media"]["track"] for message in call.media(0)] == ["inbound"]
    assert [json.loads(message)["sequenceNumber"] for message in call.media(1)] == ["3"]
    with pytest.raises(ValueError, match="one or two tracks"):
        clients.TwilioCall([])


def test_a_client_whose_handshake_ate_into_the_run_still_streams_all_its_audio():
    import asyncio
    import time

    async def chunks_sent(stop_in_s: float, lag_s: float = 0.0) -> int:
        record = clients.ClientRecord(index=0)
        done = asyncio.get_running_loop().create_future()
        sent = 0
        async for _ in clients.paced(record, 10, 0.01, stop_at=time.perf_counter() + stop_in_s,
                                     bench_start=time.perf_counter(), done=done):
            sent += 1
            await asyncio.sleep(lag_s)  # a send this slow falls behind the live pace
        return sent

    # the bench's end already past when streaming starts (a slow handshake): all 10 chunks, on time
    assert asyncio.run(chunks_sent(stop_in_s=-1.0)) == 10
    # a client falling far behind stops at the later of the bench's end and its audio's own end (0.1 s)
    assert asyncio.run(chunks_sent(stop_in_s=0.0, lag_s=0.05)) < 10
