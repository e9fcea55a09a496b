"""qasr.client against a real server on 127.0.0.1 in the same event loop: with the fake engine (fast, exact
timings) and once with the real eager engine on the tiny random checkpoint. Normal streams, stop(), rejected
streams, an unreachable server, a server that shuts down or vanishes mid-stream, and reconnecting."""

from __future__ import annotations

import asyncio
import contextlib
import types

import numpy as np
import pytest
import soundfile

from qasr.client import (ConnectionLost, Error, Final, Partial, Ready, Reconnecting, ServerUnreachable,
                         SpeechStarted, StreamClient, StreamClosed, StreamOptions, Summary, file_source, stream_audio)

# tests/ is on sys.path (tests/conftest.py)
from qasr.client import sources
from fakes import FakeEngine, speech_like, stand_in_sounddevice
from live_server import abort_connections, free_port, real_engine, serving, spoken_wav, stream_url

THREE_BURSTS = [("silence", 0.4), ("speech", 1.6), ("silence", 0.8), ("speech", 1.2), ("silence", 0.8),
                ("speech", 1.4), ("silence", 0.8)]
EXACT = {"pre_roll_ms": 0}  # segments start at the first voiced frame: comparable to the truth


def run(coroutine, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def write_wav(path, pattern, sample_rate=16000, seed=0):
    audio, truth = speech_like(pattern, sample_rate=sample_rate, seed=seed)
    soundfile.write(str(path), audio, sample_rate, subtype="PCM_16")
    return truth


def fake_engine() -> FakeEngine:
    return FakeEngine(delay_s=0.005)


async def collect(stream) -> list:
    return [event async for event in stream]


def of_type(events, kind) -> list:
    return [event for event in events if isinstance(event, kind)]


def assert_well_formed(events, num_segments, *, partials=True):
    """Ready first, summary last; each segment: speech_started, then partials, then exactly one final."""
    assert isinstance(events[0], Ready) and isinstance(events[-1], Summary)
    finals = of_type(events, Final)
    assert [final.segment_id for final in finals] == list(range(num_segments))
    for segment in range(num_segments):
        positions = {kind: [i for i, event in enumerate(events)
                            if isinstance(event, kind) and event.segment_id == segment]
                     for kind in (SpeechStarted, Partial, Final)}
        assert len(positions[SpeechStarted]) == 1 and len(positions[Final]) == 1
        if partials:
            assert positions[Partial], f"segment {segment} had no partial"
        assert all(positions[SpeechStarted][0] < i < positions[Final][0] for i in positions[Partial])
    assert events[-1].segments == num_segments


# ---------------------------------------------------------------------------------------------------------


def test_a_file_streams_to_partials_finals_with_true_times_and_a_summary(tmp_path):
    truth = write_wav(tmp_path / "talk.wav", THREE_BURSTS)

    async def main():
        async with serving(fake_engine()) as server:
            stream = stream_audio(stream_url(server.port), file_source(tmp_path / "talk.wav", speed=5.0),
                                  partial_interval_ms=400, vad=EXACT, language="english", context="qasr")
            events = await collect(stream)
            for _ in range(100):  # the server's handler finishes just after the close handshake
                if not server.connections:
                    break
                await asyncio.sleep(0.01)
            return events, stream, len(server.connections)

    events, stream, open_connections = run(main())
    assert_well_formed(events, 3)
    assert events[0].config["language"] == "English" and events[0].config["context"] == "qasr"
    for final, (start, end) in zip(of_type(events, Final), truth):
        assert final.start == pytest.approx(start, abs=0.1) and final.end == pytest.approx(end, abs=0.1)
        assert final.text == f"{final.end - final.start:.2f}s"  # the fake engine describes what it heard
    assert events[-1].audio_seconds == pytest.approx(sum(seconds for _, seconds in THREE_BURSTS))
    assert stream.client.complete and open_connections == 0


def test_msgpack_f32le_and_a_48k_source_give_the_same_finals(tmp_path):
    truth = write_wav(tmp_path / "talk48.wav", THREE_BURSTS[:4], sample_rate=48000)

    async def main():
        async with serving(fake_engine()) as server:
            source = file_source(tmp_path / "talk48.wav", realtime=False)
            return await collect(stream_audio(stream_url(server.port), source, format="msgpack", encoding="f32le",
                                              partials=False, vad=EXACT))

    events = run(main())
    assert_well_formed(events, 2, partials=False)
    assert events[0].sample_rate == 48000 and events[0].config["format"] == "msgpack"
    assert not of_type(events, Partial)
    for final, (start, end) in zip(of_type(events, Final), truth):
        assert final.start == pytest.approx(start, abs=0.1) and final.end == pytest.approx(end, abs=0.1)


def test_the_real_engine_on_the_tiny_model(tiny_model_dir, tmp_path):
    truth = spoken_wav(tmp_path / "spoken.wav", ["the quick brown fox jumps over the lazy dog",
                                                  "streaming speech recognition"])

    async def main():
        async with serving(real_engine(tiny_model_dir)) as server:
            # in real time, as a microphone sends: faster, a slow host's engine could still be on a short segment's
            # first partial when its final was due (a final supersedes its partials: a CI run saw none for segment 1)
            stream = stream_audio(stream_url(server.port), file_source(tmp_path / "spoken.wav", speed=1.0),
                                  partial_interval_ms=400)
            return await collect(stream)

    events = run(main(), timeout=60)
    assert_well_formed(events, len(truth))
    for final, (start, end) in zip(of_type(events, Final), truth):
        assert final.start <= start + 0.1 and abs(final.end - end) < 0.7 and final.reason == "silence"
        assert final.latency_ms >= 0 and isinstance(final.text, str)


def test_stop_ends_the_stream_and_the_open_segment_still_gets_its_final(tmp_path):
    write_wav(tmp_path / "long.wav", [("silence", 0.3), ("speech", 30.0)])

    async def main():
        async with serving(fake_engine()) as server:
            stream = stream_audio(stream_url(server.port), file_source(tmp_path / "long.wav", speed=10.0))
            events = []
            async for event in stream:
                events.append(event)
                if isinstance(event, Partial):
                    stream.stop()
            return events

    events = run(main())
    assert_well_formed(events, 1)
    final = of_type(events, Final)[0]
    assert final.reason == "end" and final.end < 29  # cut short, not the whole file
    assert events[-1].audio_seconds < 29


class CapturedInputStream:
    """sounddevice.InputStream without a device: start() hands over 2 s of captured audio (20 blocks of 100 ms) at
    once and then calls `on_started` (the test stops the stream there): a microphone whose blocks have not all been
    sent when the user stops."""

    on_started = None

    def __init__(self, *, callback, blocksize, channels, **_):
        self.callback, self.blocksize, self.channels = callback, blocksize, channels
        self.stopped = False

    def start(self):
        status = types.SimpleNamespace(input_overflow=False)
        for _ in range(20):
            self.callback(np.full((self.blocksize, self.channels), 0.01, np.float32), self.blocksize, None, status)
        asyncio.get_running_loop().call_soon(CapturedInputStream.on_started)  # after the blocks are handed over

    def stop(self):
        self.stopped = True

    def close(self):
        pass


def test_stop_still_sends_what_the_microphone_already_captured(monkeypatch):
    monkeypatch.setattr(sources, "_sounddevice", lambda: stand_in_sounddevice(CapturedInputStream))

    async def main():
        async with serving(fake_engine()) as server:
            microphone = sources.microphone_source()
            stream = stream_audio(stream_url(server.port), microphone)
            monkeypatch.setattr(CapturedInputStream, "on_started", stream.stop)  # at most one block sent by then
            events = [event async for event in stream]
            return events, microphone

    events, microphone = run(main())
    assert microphone._stream.stopped
    assert events[-1].audio_seconds == pytest.approx(2.0)  # every captured block reached the server


@pytest.mark.parametrize("encoding", ["mulaw", "alaw"])
def test_a_g711_8k_stream_gets_its_finals(tmp_path, encoding):
    truth = write_wav(tmp_path / "call8k.wav", THREE_BURSTS[:4], sample_rate=8000)

    async def main():
        async with serving(fake_engine()) as server:
            source = file_source(tmp_path / "call8k.wav", realtime=False)
            return await collect(stream_audio(stream_url(server.port), source, encoding=encoding, partials=False,
                                              vad=EXACT))

    events = run(main())
    assert_well_formed(events, 2, partials=False)
    assert events[0].sample_rate == 8000 and events[0].config["encoding"] == encoding
    for final, (start, end) in zip(of_type(events, Final), truth):
        assert final.start == pytest.approx(start, abs=0.1) and final.end == pytest.approx(end, abs=0.1)
    assert events[-1].audio_seconds == pytest.approx(sum(seconds for _, seconds in THREE_BURSTS[:4]))


def test_the_low_level_client_flushes_and_ends():
    audio, _ = speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.2), ("speech", 0.6)])

    async def main():
        async with serving(fake_engine()) as server:
            async with StreamClient(stream_url(server.port), StreamOptions(partials=False)) as client:
                assert client.ready.engine_sample_rate == 16000
                await client.send_audio(audio[:int(1.3 * 16000)])
                await client.flush()
                await client.send_audio((audio[int(1.3 * 16000):] * 32767).astype(np.int16))  # int16 works too
                await client.end()
                return [event async for event in client.events()]

    events = run(main())
    assert [(event.segment_id, event.reason) for event in of_type(events, Final)] == [(0, "flush"), (1, "end")]
    assert isinstance(events[-1], Summary) and events[-1].audio_seconds == pytest.approx(2.1)


def test_an_unreachable_server_is_a_friendly_error(tmp_path):
    write_wav(tmp_path / "a.wav", THREE_BURSTS[:2])
    port = free_port()  # nothing listens there

    async def main():
        with pytest.raises(ServerUnreachable, match="connection refused; is qasr-server running") as caught:
            await collect(stream_audio(stream_url(port), file_source(tmp_path / "a.wav")))
        return caught.value

    error = run(main())
    assert error.__cause__ is None and error.__suppress_context__  # no chained socket traceback


def test_a_wrong_path_and_a_wrong_url_say_what_to_fix():
    async def main():
        async with serving(fake_engine()) as server:
            with pytest.raises(ServerUnreachable, match="HTTP 404.*/v1/stream"):
                await StreamClient(f"ws://127.0.0.1:{server.port}/v2/oops").connect()

    run(main())
    with pytest.raises(ValueError, match="ws:// or wss://"):
        StreamClient("http://127.0.0.1:8765/v1/stream")


@pytest.mark.parametrize("options, code, error_code", [
    ({"language": "Klingon"}, 1003, "unsupported"),
    ({"partial_interval_ms": 5}, 1007, "malformed"),
])
def test_a_rejected_start_raises_stream_closed_with_the_code_and_the_servers_message(tmp_path, options, code,
                                                                                      error_code):
    write_wav(tmp_path / "a.wav", THREE_BURSTS[:2])

    async def main():
        async with serving(fake_engine()) as server:
            with pytest.raises(StreamClosed) as caught:
                await collect(stream_audio(stream_url(server.port), file_source(tmp_path / "a.wav"), **options))
            return caught.value

    error = run(main())
    assert error.code == code and error.error.code == error_code and not error.retryable
    assert error.error.message in str(error)


def test_a_full_server_is_retryable():
    async def main():
        async with serving(fake_engine(), max_sessions=1) as server:
            async with StreamClient(stream_url(server.port)):
                with pytest.raises(StreamClosed) as caught:
                    await StreamClient(stream_url(server.port)).connect()
            return caught.value

    error = run(main())
    assert error.code == 1013 and error.error.code == "server_full" and error.retryable


def test_a_server_shutting_down_mid_stream_delivers_the_finals_then_raises_going_away(tmp_path):
    write_wav(tmp_path / "long.wav", [("silence", 0.3), ("speech", 1.0), ("silence", 0.8), ("speech", 20.0)])

    async def main():
        async with serving(fake_engine()) as server:
            events = []
            with pytest.raises(StreamClosed) as caught:
                async for event in stream_audio(stream_url(server.port),
                                                file_source(tmp_path / "long.wav", speed=10.0)):
                    events.append(event)
                    if isinstance(event, SpeechStarted) and event.segment_id == 1:
                        asyncio.ensure_future(server.stop())
            return events, caught.value

    events, error = run(main())
    assert error.code == 1001 and error.error.code == "going_away" and error.retryable
    assert "shutting down" in str(error)
    finals = of_type(events, Final)
    assert [(final.segment_id, final.reason) for final in finals][0] == (0, "silence")
    assert len(finals) == 2 and finals[1].segment_id == 1  # the open segment was finalised before the close
    assert isinstance(events[-1], Summary)


def test_a_server_that_vanishes_mid_stream_raises_connection_lost(tmp_path):
    write_wav(tmp_path / "long.wav", [("silence", 0.3), ("speech", 20.0)])

    async def main():
        async with serving(fake_engine()) as server:
            events = []
            with pytest.raises(ConnectionLost) as caught:
                async for event in stream_audio(stream_url(server.port),
                                                file_source(tmp_path / "long.wav", speed=10.0)):
                    events.append(event)
                    if isinstance(event, SpeechStarted):
                        abort_connections(server)
            return events, caught.value

    events, error = run(main())
    assert error.code == 1006 and error.retryable and "lost" in str(error)
    assert isinstance(events[-1], SpeechStarted)


async def stream_across_a_restart(port: int, wav, stop_first) -> list:
    """Stream `wav` (4x speed, reconnecting) to a server on `port`; `stop_first(event, server)` sees every event and
    may stop the first server; when the client reconnects, a fresh server takes the same port. -> all events."""
    events = []
    async with contextlib.AsyncExitStack() as servers:
        first = await servers.enter_async_context(serving(fake_engine(), port=port))
        stream = stream_audio(stream_url(port), file_source(wav, speed=4.0), vad=EXACT, reconnect=5,
                              reconnect_delay_s=0.05)
        restarted = False
        async for event in stream:
            events.append(event)
            stop_first(event, first)
            if isinstance(event, Reconnecting) and not restarted:
                await first.wait_stopped()
                await servers.enter_async_context(serving(fake_engine(), port=port))
                restarted = True
    return events


def test_reconnect_continues_the_timeline_after_a_server_restart(tmp_path):
    pattern = [("silence", 0.3), ("speech", 1.0), ("silence", 0.8), ("speech", 1.0), ("silence", 0.8),
               ("speech", 1.0), ("silence", 0.8), ("speech", 1.0), ("silence", 0.8)]
    truth = write_wav(tmp_path / "talk.wav", pattern)
    port = free_port()

    def stop_after_the_first_final(event, first):
        if isinstance(event, Final) and event.segment_id == 0:
            asyncio.ensure_future(first.stop())  # SIGTERM: finals, then 1001

    events = run(stream_across_a_restart(port, tmp_path / "talk.wav", stop_after_the_first_final))
    readies, reconnects = of_type(events, Ready), of_type(events, Reconnecting)
    assert len(readies) == 2 and len(reconnects) >= 1
    assert "shutting down" in reconnects[0].reason
    finals = of_type(events, Final)
    assert [final.segment_id for final in finals] == list(range(len(finals)))  # numbering continues
    assert len(finals) >= 3  # at most the burst that was cut by the restart is lost or split
    assert all(a.end <= b.start for a, b in zip(finals, finals[1:]))  # one timeline
    for final in finals:  # every final lies on a true burst of the file's own timeline
        assert any(start - 0.1 <= final.start and final.end <= end + 0.1 for start, end in truth), final
    assert events[-1].audio_seconds == pytest.approx(sum(seconds for _, seconds in pattern), abs=0.15)


def test_without_reconnect_a_restart_is_not_retried(tmp_path):
    write_wav(tmp_path / "long.wav", [("silence", 0.3), ("speech", 20.0)])

    async def main():
        async with serving(fake_engine()) as server:
            events = []
            with pytest.raises(StreamClosed):
                async for event in stream_audio(stream_url(server.port),
                                                file_source(tmp_path / "long.wav", speed=10.0)):
                    events.append(event)
                    if isinstance(event, SpeechStarted):
                        asyncio.ensure_future(server.stop())
            return events

    assert not of_type(run(main()), Reconnecting)


def test_a_failing_source_ends_the_stream_cleanly_then_raises_its_error():
    audio, _ = speech_like([("silence", 0.3), ("speech", 1.0)])

    async def broken_source():
        yield audio
        raise OSError("the microphone was unplugged")

    async def main():
        async with serving(fake_engine()) as server:
            events = []
            with pytest.raises(OSError, match="unplugged"):
                async for event in stream_audio(stream_url(server.port), broken_source()):
                    events.append(event)
            return events

    events = run(main())
    assert isinstance(events[-1], Summary) and of_type(events, Final)[0].reason == "end"


def test_non_fatal_errors_are_events(tmp_path):
    write_wav(tmp_path / "a.wav", THREE_BURSTS[:2])

    async def main():
        async with serving(fake_engine()) as server:
            return await collect(stream_audio(stream_url(server.port), file_source(tmp_path / "a.wav", speed=20),
                                              vad={"colour": "blue"}))

    events = run(main())
    errors = of_type(events, Error)
    assert [(error.code, error.fatal) for error in errors] == [("unknown_field", False)]
    assert isinstance(events[-1], Summary)


def test_a_send_stuck_on_backpressure_when_the_connection_drops_is_resent_after_the_reconnect(tmp_path,
                                                                                               monkeypatch):
    """A reconnect cancels the pump while a send waits for the server to read (backpressure): that chunk must go
    out first on the new connection, or it is lost and every later time is one chunk early."""
    pattern = [("silence", 0.3), ("speech", 1.0), ("silence", 0.8), ("speech", 1.0), ("silence", 0.8)]
    write_wav(tmp_path / "talk.wav", pattern)
    port = free_port()
    send_audio, sends = StreamClient.send_audio, []

    async def stuck_once(client, chunk):  # the 8th send never completes on its connection, as under backpressure
        sends.append(len(chunk))
        if len(sends) == 8:
            await asyncio.Event().wait()
        await send_audio(client, chunk)

    monkeypatch.setattr(StreamClient, "send_audio", stuck_once)

    def stop_when_stuck(event, first):
        if isinstance(event, Ready) and len(sends) < 8:
            asyncio.ensure_future(restart_when_stuck(first))

    async def restart_when_stuck(server):
        while len(sends) < 8:
            await asyncio.sleep(0.01)
        await server.stop()  # 1001 while the 8th send is still waiting

    events = run(stream_across_a_restart(port, tmp_path / "talk.wav", stop_when_stuck))
    assert len(of_type(events, Ready)) == 2
    summary = events[-1]
    assert isinstance(summary, Summary)
    # every sample of the file reached a server, once: the timeline after the reconnect is the file's own
    assert summary.audio_seconds == pytest.approx(sum(seconds for _, seconds in pattern), abs=0.01)


async def stream_across_a_drain_behind_the_reader(port: int, wav, *, drain_when) -> tuple[list, float]:
    """Stream `wav` (4x speed, reconnecting) to a server that stops reading once segment 0's final is pending (its
    engine answers only when told, max_pending_finals=1): the client sends on into the socket. When
    `drain_when(client)` holds, the server is stopped (SIGTERM: it finalises what it read, summary, 1001) and a
    fresh one takes the port. -> (all events, seconds the client had sent when the drain began)."""
    first_engine = FakeEngine(manual=True)
    events, drained_at = [], []
    async with contextlib.AsyncExitStack() as servers:
        first = await servers.enter_async_context(serving(first_engine, port=port, max_pending_finals=1))
        stream = stream_audio(stream_url(port), file_source(wav, speed=4.0), vad=EXACT, partials=False,
                              reconnect=5, reconnect_delay_s=0.05)

        async def drain_behind_the_reader():
            while stream.client is None or stream.client.ready is None or not drain_when(stream.client):
                await asyncio.sleep(0.01)
            drained_at.append(stream.client.samples_sent / 16000)
            stopping = asyncio.ensure_future(first.stop())
            while not stopping.done():  # the drain's finals are decoded as soon as they are asked for
                for call in first_engine.pending():
                    first_engine.complete(call)
                await asyncio.sleep(0.01)

        drain = asyncio.ensure_future(drain_behind_the_reader())
        restarted = False
        try:
            async for event in stream:
                events.append(event)
                if isinstance(event, Reconnecting) and not restarted:
                    await first.wait_stopped()
                    await servers.enter_async_context(serving(fake_engine(), port=port))
                    restarted = True
        finally:
            drain.cancel()
    return events, drained_at[0]


@pytest.mark.parametrize("drain_when", ["mid_stream", "after_end"])
def test_audio_a_draining_server_never_read_is_sent_again_after_the_reconnect(tmp_path, drain_when):
    """A drain ends reading at once: audio already sent (in the socket, a proxy, the server's queue) was never
    transcribed. The drain's summary says how much the server read; the rest goes again on the next connection, at
    its own place on the timeline, also when the source had ended and `end` had gone out (which the drained server
    never read either). Every burst gets a final; every sample is heard exactly once."""
    pattern = [("silence", 0.3), ("speech", 1.0), ("silence", 0.8), ("speech", 1.5), ("silence", 0.8),
               ("speech", 1.0), ("silence", 0.8), ("speech", 1.0), ("silence", 0.8)]
    truth = write_wav(tmp_path / "talk.wav", pattern)
    condition = {"mid_stream": lambda client: client.samples_sent >= 5 * 16000,  # two bursts unread
                 "after_end": lambda client: client.ended}[drain_when]

    events, drained_at_s = run(stream_across_a_drain_behind_the_reader(free_port(), tmp_path / "talk.wav",
                                                                        drain_when=condition))
    heard_s = of_type(events, Summary)[0].audio_seconds  # the drained server's
    assert heard_s < 2.5 < drained_at_s  # it stopped reading after the first burst; the client sent on
    finals = of_type(events, Final)
    assert [final.segment_id for final in finals] == list(range(len(finals)))
    assert all(a.end <= b.start for a, b in zip(finals, finals[1:]))
    for start, end in truth:  # no burst went without a final
        assert any(final.start < end and start < final.end for final in finals), (start, end, finals)
    summary = events[-1]
    assert isinstance(summary, Summary)
    assert summary.audio_seconds == pytest.approx(sum(seconds for _, seconds in pattern), abs=1e-6)
    reconnect = of_type(events, Reconnecting)[0]
    assert "shutting down" in reconnect.reason
    assert reconnect.resend_s == pytest.approx(drained_at_s - heard_s) and reconnect.lost_s == 0
