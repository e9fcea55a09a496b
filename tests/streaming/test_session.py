"""Session: VAD-driven partials and finals against a fake engine, and the ordering guarantees clients rely on."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from qasr.streaming import events
from qasr.engine.request import EngineClosed, Priority, Superseded
from qasr.streaming.session import Session, SessionObserver, SessionOptions
from qasr.streaming.vad import VadOptions

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine, speech_like

TWO_BURSTS = [("silence", 0.5), ("speech", 1.2), ("silence", 0.8), ("speech", 0.7), ("silence", 1.0)]
EXACT_VAD = VadOptions(pre_roll_ms=0)  # segments start at the first voiced frame: comparable to the truth


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=20))


async def settle(rounds: int = 10) -> None:
    """Let the session's tasks and the fake engine run."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def feed(session: Session, audio: np.ndarray, chunk: int = 1600, engine: FakeEngine | None = None) -> None:
    """Feed in chunks (100 ms at 16 kHz), letting tasks run in between; in manual mode answer partials at once."""
    for start in range(0, len(audio), chunk):
        session.feed(audio[start:start + chunk])
        await settle()
        if engine is not None:
            for call in engine.pending(Priority.PARTIAL):
                engine.complete(call)
            await settle()


async def drain(session: Session) -> list:
    out = []
    while (event := await asyncio.wait_for(session.next_event(), 5)) is not None:
        out.append(event)
    return out


def take_ready(session: Session) -> list:
    out = []
    while session._outbox:
        out.append(session._outbox.popleft())
    return out


def kinds(event_list) -> list[str]:
    return [event.TYPE for event in event_list]


def check_ordering(event_list) -> None:
    """The contract: started -> partials -> exactly one final per segment; finals in order; summary last."""
    started, finalised = [], []
    for event in event_list:
        if isinstance(event, events.SpeechStarted):
            assert event.segment_id not in started
            started.append(event.segment_id)
        elif isinstance(event, events.Partial):
            assert event.segment_id in started and event.segment_id not in finalised
        elif isinstance(event, events.Final):
            assert event.segment_id in started and event.segment_id not in finalised
            finalised.append(event.segment_id)
    assert finalised == sorted(finalised) == started
    assert isinstance(event_list[-1], events.Summary)
    assert event_list[-1].segments == len(finalised)


def test_two_bursts_give_two_finals_with_true_timestamps_and_a_summary():
    async def main():
        engine = FakeEngine()
        session = Session(engine, "s1", SessionOptions(vad=EXACT_VAD))
        audio, truth = speech_like(TWO_BURSTS)
        await feed(session, audio)
        session.end()
        return engine, await drain(session)

    engine, out = run(main())
    check_ordering(out)
    finals = [event for event in out if isinstance(event, events.Final)]
    assert [final.segment_id for final in finals] == [0, 1]
    for final, (start, end) in zip(finals, speech_like(TWO_BURSTS)[1]):
        assert abs(final.start - start) < 0.1 and abs(final.end - end) < 0.1
        assert final.reason == "silence"
        assert final.text == f"{final.end - final.start:.2f}s"  # the final carried exactly the segment's audio
        assert final.language == "English" and final.latency_ms >= 0
    summary = out[-1]
    assert summary.audio_seconds == pytest.approx(4.2)
    assert summary.speech_seconds == pytest.approx(sum(f.end - f.start for f in finals))
    assert sorted(engine.released) == ["s1/0", "s1/1"] and not engine.streams


def test_segment_open_at_end_gets_its_final_with_reason_end():
    async def main():
        session = Session(FakeEngine(), "s", SessionOptions(partials=False, vad=EXACT_VAD))
        audio, _ = speech_like([("silence", 0.3), ("speech", 1.0)])
        await feed(session, audio)
        session.end()
        return await drain(session)

    out = run(main())
    assert kinds(out) == ["speech_started", "final", "summary"]
    assert out[1].reason == "end" and out[1].end == pytest.approx(1.3, abs=0.1)


def test_end_without_speech_gives_only_a_summary():
    async def main():
        session = Session(FakeEngine(), "s")
        await feed(session, speech_like([("silence", 1.0)])[0])
        session.end()
        session.end()  # idempotent
        return await drain(session)

    out = run(main())
    assert out == [events.Summary(segments=0, audio_seconds=1.0, speech_seconds=0.0)]


def test_flush_closes_the_open_segment_and_the_stream_goes_on_with_absolute_times():
    async def main():
        session = Session(FakeEngine(), "s", SessionOptions(partials=False, vad=EXACT_VAD))
        first, _ = speech_like([("silence", 0.3), ("speech", 0.8)], seed=1)
        await feed(session, first)
        session.flush()
        second, _ = speech_like([("silence", 0.6), ("speech", 0.8), ("silence", 0.8)], seed=2)
        await feed(session, second)
        session.end()
        return await drain(session)

    out = run(main())
    check_ordering(out)
    finals = [event for event in out if isinstance(event, events.Final)]
    assert [(f.segment_id, f.reason) for f in finals] == [(0, "flush"), (1, "silence")]
    assert finals[0].end == pytest.approx(1.1, abs=0.1)
    assert finals[1].start == pytest.approx(1.1 + 0.6, abs=0.1)  # offsets continue across the flush
    assert out[-1].audio_seconds == pytest.approx(1.1 + 2.2)


def test_partials_come_every_interval_of_new_speech_with_a_rolled_back_prefix():
    async def main():
        engine = FakeEngine(manual=True)
        session = Session(engine, "s", SessionOptions(partial_interval_ms=1000, vad=EXACT_VAD),
                          rollback=lambda raw: raw[:-2])
        audio, _ = speech_like([("silence", 0.3), ("speech", 3.4)])
        await feed(session, audio, engine=engine)
        return engine, take_ready(session)

    engine, out = run(main())
    partial_requests = [call.request for call in engine.calls if call.request.priority is Priority.PARTIAL]
    lengths = [len(request.audio) / 16000 for request in partial_requests]
    assert len(lengths) == 3  # at ~1, ~2, ~3 s of segment audio
    assert all(later - earlier >= 1.0 for earlier, later in zip(lengths, lengths[1:]))
    assert lengths[0] == pytest.approx(1.0, abs=0.1)
    assert partial_requests[0].text_prefix == ""
    assert partial_requests[1].text_prefix == engine.result_for(partial_requests[0]).raw_text[:-2]
    assert {request.stream_id for request in partial_requests} == {"s/0"}
    partials = [event for event in out if isinstance(event, events.Partial)]
    assert [p.end - p.start for p in partials] == pytest.approx(lengths)
    assert kinds(out)[0] == "speech_started"


def test_at_most_one_partial_in_flight_and_the_next_one_follows_its_answer():
    async def main():
        engine = FakeEngine(manual=True)
        session = Session(engine, "s", SessionOptions(partial_interval_ms=500, vad=EXACT_VAD))
        audio, _ = speech_like([("silence", 0.3), ("speech", 3.0)])
        await feed(session, audio)  # nobody answers the partial
        assert len(engine.calls) == 1 and session.num_tasks == 1
        engine.complete(engine.calls[0])
        await settle()
        assert len(engine.calls) == 2  # overdue: asked at once, with all the audio so far
        assert len(engine.calls[1].request.audio) > len(engine.calls[0].request.audio)

    run(main())


def test_a_partial_in_flight_when_its_segment_closes_is_cancelled_and_never_sent():
    async def main():
        engine = FakeEngine(manual=True)
        session = Session(engine, "s", SessionOptions(partial_interval_ms=500, vad=EXACT_VAD))
        audio, _ = speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.8)])
        await feed(session, audio)
        partial, final = engine.calls[0], engine.calls[-1]
        assert partial.request.priority is Priority.PARTIAL and final.request.priority is Priority.FINAL
        assert partial.request in engine.cancelled
        engine.complete(final)
        session.end()
        return engine, await drain(session)

    engine, out = run(main())
    assert kinds(out) == ["speech_started", "final", "summary"]
    assert engine.released == ["s/0"]


def test_a_superseded_or_failed_partial_is_dropped_and_streaming_goes_on():
    async def main():
        engine = FakeEngine(manual=True)
        session = Session(engine, "s", SessionOptions(partial_interval_ms=500, vad=EXACT_VAD))
        audio, _ = speech_like([("silence", 0.3), ("speech", 2.0)])
        await feed(session, audio[:16000])
        engine.fail(engine.calls[0], Superseded("newer"))
        await settle()
        await feed(session, audio[16000:24000])
        engine.fail(engine.pending(Priority.PARTIAL)[0], RuntimeError("boom"))
        await settle()
        await feed(session, audio[24000:])
        engine.complete(engine.pending(Priority.PARTIAL)[0])
        await settle()
        return take_ready(session)

    out = run(main())
    assert kinds(out) == ["speech_started", "partial"]


def test_finals_are_sent_in_segment_order_even_when_decoded_out_of_order():
    async def main():
        engine = FakeEngine(manual=True)
        session = Session(engine, "s", SessionOptions(partials=False, vad=EXACT_VAD))
        audio, _ = speech_like(TWO_BURSTS)
        await feed(session, audio)
        first, second = engine.pending(Priority.FINAL)
        engine.complete(second)
        await settle()
        before = take_ready(session)
        engine.complete(first)
        await settle()
        session.end()
        return before, await drain(session)

    before, after = run(main())
    assert "final" not in kinds(before)
    assert kinds(after) == ["final", "final", "summary"]
    assert [event.segment_id for event in after[:2]] == [0, 1]


def test_a_failed_final_still_gives_exactly_one_final_after_an_error_event():
    async def main():
        engine = FakeEngine(manual=True)
        session = Session(engine, "s", SessionOptions(partials=False, vad=EXACT_VAD))
        audio, _ = speech_like(TWO_BURSTS)
        await feed(session, audio)
        first, second = engine.pending(Priority.FINAL)
        engine.fail(first, RuntimeError("CUDA went away"))
        engine.complete(second)
        session.end()
        return engine, await drain(session)

    engine, out = run(main())
    assert kinds(out) == ["speech_started", "speech_started", "error", "final", "final", "summary"]
    error, failed = out[2], out[3]
    assert error.code == "decode_failed" and not error.fatal and "CUDA" not in error.message
    assert failed.segment_id == 0 and failed.text == ""
    assert sorted(engine.released) == ["s/0", "s/1"]


def test_engine_closed_is_raised_to_the_consumer():
    async def main():
        engine = FakeEngine(manual=True)
        session = Session(engine, "s", SessionOptions(partials=False))
        await feed(session, speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.8)])[0])
        await engine.close()
        assert isinstance(await session.next_event(), events.SpeechStarted)
        with pytest.raises(EngineClosed):
            await session.next_event()
        await session.abort()
        assert not engine.streams

    run(main())


def test_abort_cancels_engine_work_releases_streams_and_ends_the_events():
    async def main():
        engine = FakeEngine(manual=True)
        session = Session(engine, "s", SessionOptions(partial_interval_ms=500, vad=EXACT_VAD))
        audio, _ = speech_like(TWO_BURSTS + [("speech", 1.5)])
        await feed(session, audio)
        assert session.num_tasks == 3  # two finals and the open segment's partial
        cancelled_before = len(engine.cancelled)  # the closed segments' partials
        await session.abort()
        await session.abort()
        assert session.num_tasks == 0
        assert len(engine.cancelled) - cancelled_before == 3 and not engine.waiting
        assert not engine.streams and sorted(engine.released) == ["s/0", "s/1", "s/2"]
        assert await session.next_event() is None
        with pytest.raises(RuntimeError):
            session.feed(audio[:160])

    run(main())


def test_wait_for_capacity_blocks_while_too_many_finals_are_pending():
    async def main():
        engine = FakeEngine(manual=True)
        session = Session(engine, "s", SessionOptions(partials=False, max_pending_finals=2, vad=EXACT_VAD))
        audio, _ = speech_like(TWO_BURSTS)
        await feed(session, audio)
        waiter = asyncio.ensure_future(session.wait_for_capacity())
        await settle()
        assert not waiter.done()
        engine.complete(engine.pending(Priority.FINAL)[0])
        await settle()
        assert not waiter.done()  # the final is made but not yet sent: it still counts against the client
        while not isinstance(await session.next_event(), events.Final):
            pass
        await asyncio.wait_for(waiter, 1)
        await session.abort()

    run(main())


def test_a_slow_reader_gets_the_newest_partial_not_a_backlog():
    async def main():
        session = Session(FakeEngine(), "s", SessionOptions(partial_interval_ms=200, vad=EXACT_VAD))
        audio, _ = speech_like([("silence", 0.3), ("speech", 6.0)])
        await feed(session, audio, chunk=800)  # nobody reads while partials keep coming
        await settle()
        backlog = list(session._outbox)
        await session.abort()
        return backlog

    backlog = run(main())
    partials = [event for event in backlog if isinstance(event, events.Partial)]
    assert len(backlog) <= 8 + 1 and partials  # without the replacement: ~20 events (one partial per 200 ms)
    assert partials[-1].end == max(p.end for p in partials)  # the newest hypothesis is the one kept


def test_other_input_rates_are_resampled_and_timestamps_stay_true():
    async def main():
        session = Session(FakeEngine(), "s", SessionOptions(input_rate=48000, partials=False, vad=EXACT_VAD))
        audio, truth = speech_like(TWO_BURSTS, sample_rate=48000)
        await feed(session, audio, chunk=4800)
        session.end()
        return truth, await drain(session)

    truth, out = run(main())
    finals = [event for event in out if isinstance(event, events.Final)]
    assert len(finals) == 2
    for final, (start, end) in zip(finals, truth):
        assert abs(final.start - start) < 0.1 and abs(final.end - end) < 0.1
    assert out[-1].audio_seconds == pytest.approx(4.2)


def test_final_latency_is_measured_from_the_end_decision_and_reported_to_the_observer():
    now = [100.0]

    class Recorder(SessionObserver):
        def __init__(self):
            self.finals, self.partials, self.segments = [], [], 0

        def segment_started(self):
            self.segments += 1

        def final_sent(self, latency_s):
            self.finals.append(latency_s)

        def partial_sent(self, latency_s):
            self.partials.append(latency_s)

    async def main():
        engine, recorder = FakeEngine(manual=True), Recorder()
        session = Session(engine, "s", SessionOptions(partial_interval_ms=500), observer=recorder,
                          clock=lambda: now[0])
        await feed(session, speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.8)])[0])
        now[0] += 0.25
        engine.complete(engine.pending(Priority.FINAL)[0])
        await settle()
        return recorder, take_ready(session)

    recorder, out = run(main())
    final = [event for event in out if isinstance(event, events.Final)][0]
    assert final.latency_ms == pytest.approx(250.0)
    assert recorder.finals == [pytest.approx(0.25)] and recorder.segments == 1
