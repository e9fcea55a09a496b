"""StreamRunner: a session's engine work on a (fake) engine, on an event loop: cancellation, release, the engine
closing, backpressure and the metrics hooks."""

from __future__ import annotations

import asyncio

import pytest

from qasr.engine.request import Priority
from qasr.server.errors import EngineStopped, decide_close
from qasr.server.stream_runner import DecodeObserver, StreamRunner
from qasr.streaming import events
from qasr.streaming.session import Session
from qasr.streaming.settings import StreamSettings, VadSettings

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine, speech_like

TWO_BURSTS = [("silence", 0.5), ("speech", 1.2), ("silence", 0.8), ("speech", 0.7), ("silence", 1.0)]


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=20))


async def settle(rounds: int = 10) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def runner(engine: FakeEngine, observer=None, max_pending_finals: int = 16, **fields) -> StreamRunner:
    settings = StreamSettings(vad=VadSettings(pre_roll_ms=0), **fields)
    return StreamRunner(Session("s", settings, max_pending_finals=max_pending_finals), engine, observer=observer)


async def feed(stream: StreamRunner, audio, chunk: int = 1600) -> None:
    for start in range(0, len(audio), chunk):
        stream.feed(audio[start:start + chunk])
        await settle()


async def drain(stream: StreamRunner) -> list:
    out = []
    while (event := await asyncio.wait_for(stream.next_event(), 5)) is not None:
        out.append(event)
    return out


def test_a_stream_runs_on_the_engine_and_ends_with_its_summary():
    class Recorder(DecodeObserver):
        def __init__(self):
            self.outcomes, self.failed = [], []

        def decoded(self, priority, timings):
            self.outcomes.append((priority, timings["decode_ms"]))

        def decode_failed(self, priority):
            self.failed.append(priority)

    async def main():
        engine, recorder = FakeEngine(delay_s=0.001), Recorder()
        stream = runner(engine, recorder, partials=False)
        await feed(stream, speech_like(TWO_BURSTS)[0])
        stream.end()
        out = await drain(stream)
        assert await stream.next_event() is None
        return engine, recorder, out

    engine, recorder, out = run(main())
    assert sorted(event.TYPE for event in out) == sorted(["speech_started", "speech_ended", "final"] * 2 + ["summary"])
    assert [event.segment_id for event in out if isinstance(event, events.Final)] == [0, 1]
    assert isinstance(out[-1], events.Summary) and out[-1].segments == 2
    assert [call.request.priority for call in engine.calls] == [Priority.FINAL, Priority.FINAL]
    assert [call.request.stream_id for call in engine.calls] == ["s/0", "s/1"]
    assert sorted(engine.released) == ["s/0", "s/1"] and not engine.streams
    assert recorder.outcomes == [(Priority.FINAL, 60.0)] * 2 and recorder.failed == []


def test_a_partial_cancelled_by_its_segments_close_cancels_the_engine_call():
    async def main():
        engine = FakeEngine(manual=True)
        stream = runner(engine, partial_interval_ms=500)
        await feed(stream, speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.8)])[0])
        partial, final = engine.calls[0], engine.calls[-1]
        assert partial.request.priority is Priority.PARTIAL and final.request.priority is Priority.FINAL
        assert partial.request in engine.cancelled
        engine.complete(final)
        stream.end()
        return engine, await drain(stream)

    engine, out = run(main())
    assert [event.TYPE for event in out] == ["speech_started", "speech_ended", "final", "summary"]
    assert engine.released == ["s/0"]


def test_the_engine_closing_is_raised_to_the_consumer_after_the_events_made_before_it():
    async def main():
        engine = FakeEngine(manual=True)
        stream = runner(engine, partials=False)
        await feed(stream, speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.8)])[0])
        await engine.close()
        await settle()
        assert isinstance(await stream.next_event(), events.SpeechStarted)
        assert isinstance(await stream.next_event(), events.SpeechEnded)
        with pytest.raises(EngineStopped) as caught:
            await stream.next_event()
        with pytest.raises(EngineStopped):
            await stream.wait_for_capacity()
        assert decide_close(caught.value, stopping=True).close_code == 1001  # the server is stopping
        died = decide_close(caught.value)  # the engine died under a running server
        assert (died.close_code, died.message) == (1011, "internal server error")
        await stream.abort()
        assert not engine.streams

    run(main())


def test_a_failed_decode_fails_only_its_segment_and_is_counted():
    class Recorder(DecodeObserver):
        failed: list = []

        def decode_failed(self, priority):
            self.failed.append(priority)

    async def main():
        engine = FakeEngine(delay_s=0.001)
        engine.fail_with = RuntimeError("a NaN")
        stream = runner(engine, Recorder(), partials=False)
        await feed(stream, speech_like(TWO_BURSTS)[0])
        stream.end()
        return await drain(stream)

    out = run(main())
    assert [event.code for event in out if isinstance(event, events.Error)] == ["decode_failed"] * 2
    assert [event.text for event in out if isinstance(event, events.Final)] == ["", ""]
    assert Recorder.failed == [Priority.FINAL, Priority.FINAL]


def test_abort_cancels_engine_work_releases_streams_and_ends_the_events():
    async def main():
        engine = FakeEngine(manual=True)
        stream = runner(engine, partial_interval_ms=500)
        await feed(stream, speech_like(TWO_BURSTS + [("speech", 1.5)])[0])
        assert stream.num_tasks == 3  # two finals and the open segment's partial
        cancelled_before = len(engine.cancelled)  # the closed segments' partials
        await stream.abort()
        await stream.abort()
        assert stream.num_tasks == 0
        assert len(engine.cancelled) - cancelled_before == 3 and not engine.waiting
        assert not engine.streams and sorted(engine.released) == ["s/0", "s/1", "s/2"]
        assert await stream.next_event() is None
        with pytest.raises(RuntimeError):
            stream.feed(speech_like([("silence", 0.01)])[0])

    run(main())


def test_wait_for_capacity_blocks_while_too_many_finals_are_pending():
    async def main():
        engine = FakeEngine(manual=True)
        stream = runner(engine, partials=False, max_pending_finals=2)
        await feed(stream, speech_like(TWO_BURSTS)[0])
        waiter = asyncio.ensure_future(stream.wait_for_capacity())
        await settle()
        assert not waiter.done()
        engine.complete(engine.pending(Priority.FINAL)[0])
        await settle()
        assert not waiter.done()  # the final is made but not yet sent: it still counts against the client
        while not isinstance(await stream.next_event(), events.Final):
            pass
        await asyncio.wait_for(waiter, 1)
        await stream.abort()

    run(main())
