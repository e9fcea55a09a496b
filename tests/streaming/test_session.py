"""Session, sans-I/O: VAD-driven partials and finals against a synchronous stand-in for the engine, and the ordering
guarantees clients rely on. No event loop: the test plays the engine by answering the session's actions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qasr.streaming import events
from qasr.streaming.session import Cancel, Decode, Release, Session, SessionObserver
from qasr.streaming.settings import StreamSettings, VadSettings

# tests/ is on sys.path (tests/conftest.py)
from fakes import speech_like

TWO_BURSTS = [("silence", 0.5), ("speech", 1.2), ("silence", 0.8), ("speech", 0.7), ("silence", 1.0)]
EXACT_VAD = VadSettings(pre_roll_ms=0)  # segments start at the first voiced frame: comparable to the truth


def settings(**fields) -> StreamSettings:
    return dataclasses.replace(StreamSettings(vad=EXACT_VAD), **fields)


@dataclasses.dataclass(frozen=True)
class Transcript:
    text: str
    language: str = "English"


def describe(request: Decode) -> Transcript:
    """The stand-in engine's transcript says how much audio it heard, so tests can check what each request carried."""
    return Transcript(f"{len(request.audio) / 16000:.2f}s")


class Engine:
    """Plays the engine for a session: runs its actions; answers each Decode at once (auto) or when told."""

    def __init__(self, session: Session, *, auto: bool = True):
        self.session = session
        self.auto = auto
        self.requests: list[Decode] = []  # every Decode, in order
        self.waiting: dict[int, Decode] = {}  # asked, not answered, not cancelled
        self.cancelled: list[Decode] = []
        self.released: list[str] = []

    def run(self) -> None:
        while actions := self.session.take_actions():
            for action in actions:
                if isinstance(action, Decode):
                    self.requests.append(action)
                    self.waiting[action.request_id] = action
                elif isinstance(action, Cancel):
                    self.cancelled.append(self.waiting.pop(action.request_id))
                else:
                    assert isinstance(action, Release)
                    self.released.append(action.stream_id)
            if self.auto:
                for request in list(self.waiting.values()):
                    self.answer(request)

    def pending(self, partial: bool | None = None) -> list[Decode]:
        return [request for request in self.waiting.values() if partial is None or request.partial is partial]

    def answer(self, request: Decode, result="describe") -> None:
        """result: a transcript, None (the engine dropped it) or an exception; by default the audio's length."""
        del self.waiting[request.request_id]
        self.session.on_result(request.request_id, describe(request) if result == "describe" else result)
        self.run()

    @property
    def streams(self) -> set[str]:
        """Streams that had work and were not released."""
        return {request.stream_id for request in self.requests} - set(self.released)


def feed(session: Session, engine: Engine, audio: np.ndarray, chunk: int = 1600) -> None:
    """Feed in chunks (100 ms at 16 kHz), letting the engine run in between."""
    for start in range(0, len(audio), chunk):
        session.feed(audio[start:start + chunk])
        engine.run()


def take_all(session: Session) -> list:
    out = []
    while (event := session.take_event()) is not None:
        out.append(event)
    return out


def kinds(event_list) -> list[str]:
    return [event.TYPE for event in event_list]


def check_ordering(event_list) -> None:
    """The contract: started -> partials -> ended -> exactly one final per segment; finals in order; summary last."""
    started, ended, finalised = [], [], []
    for event in event_list:
        if isinstance(event, events.SpeechStarted):
            assert event.segment_id not in started
            started.append(event.segment_id)
        elif isinstance(event, events.Partial):
            assert event.segment_id in started and event.segment_id not in ended
        elif isinstance(event, events.SpeechEnded):
            assert event.segment_id in started and event.segment_id not in ended
            ended.append(event.segment_id)
        elif isinstance(event, events.Final):
            assert event.segment_id in ended and event.segment_id not in finalised
            finalised.append(event.segment_id)
    assert finalised == sorted(finalised) == started == ended
    assert isinstance(event_list[-1], events.Summary)
    assert event_list[-1].segments == len(finalised)


def test_two_bursts_give_two_finals_with_true_timestamps_and_a_summary():
    session = Session("s1", settings())
    engine = Engine(session)
    audio, truth = speech_like(TWO_BURSTS)
    feed(session, engine, audio)
    session.end()
    engine.run()
    out = take_all(session)
    check_ordering(out)
    finals = [event for event in out if isinstance(event, events.Final)]
    assert [final.segment_id for final in finals] == [0, 1]
    ended = [event for event in out if isinstance(event, events.SpeechEnded)]
    for final, speech_ended, (start, end) in zip(finals, ended, truth):
        assert abs(final.start - start) < 0.1 and abs(final.end - end) < 0.1
        assert speech_ended.end == final.end
        assert final.reason == "silence"
        assert final.text == f"{final.end - final.start:.2f}s"  # the final carried exactly the segment's audio
        assert final.language == "English" and final.latency_ms >= 0
    summary = out[-1]
    assert summary.audio_seconds == pytest.approx(4.2)
    assert summary.speech_seconds == pytest.approx(sum(f.end - f.start for f in finals))
    assert sorted(engine.released) == ["s1/0", "s1/1"] and not engine.streams


def test_segment_open_at_end_gets_its_final_with_reason_end():
    session = Session("s", settings(partials=False))
    engine = Engine(session)
    feed(session, engine, speech_like([("silence", 0.3), ("speech", 1.0)])[0])
    session.end()
    engine.run()
    out = take_all(session)
    assert kinds(out) == ["speech_started", "speech_ended", "final", "summary"]
    assert out[2].reason == "end" and out[2].end == pytest.approx(1.3, abs=0.1)


def test_end_without_speech_gives_only_a_summary():
    session = Session("s")
    engine = Engine(session)
    feed(session, engine, speech_like([("silence", 1.0)])[0])
    session.end()
    session.end()  # idempotent
    assert take_all(session) == [events.Summary(segments=0, audio_seconds=1.0, speech_seconds=0.0)]
    assert engine.requests == []


def test_flush_closes_the_open_segment_and_the_stream_goes_on_with_absolute_times():
    session = Session("s", settings(partials=False))
    engine = Engine(session)
    first, _ = speech_like([("silence", 0.3), ("speech", 0.8)], seed=1)
    feed(session, engine, first)
    segmenter = session._segmenter
    session.flush()
    engine.run()
    second, _ = speech_like([("silence", 0.6), ("speech", 0.8), ("silence", 0.8)], seed=2)
    feed(session, engine, second)
    session.end()
    engine.run()
    out = take_all(session)
    check_ordering(out)
    assert session._segmenter is segmenter or session._segmenter is None  # continued, never rebuilt
    finals = [event for event in out if isinstance(event, events.Final)]
    assert [(f.segment_id, f.reason) for f in finals] == [(0, "flush"), (1, "silence")]
    assert finals[0].end == pytest.approx(1.1, abs=0.1)
    assert finals[1].start == pytest.approx(1.1 + 0.6, abs=0.1)  # offsets continue across the flush
    assert out[-1].audio_seconds == pytest.approx(1.1 + 2.2)
    assert [request.stream_id for request in engine.requests] == ["s/0", "s/1"]


def test_partials_come_every_interval_of_new_speech():
    session = Session("s", settings(partial_interval_ms=1000))
    engine = Engine(session)
    feed(session, engine, speech_like([("silence", 0.3), ("speech", 3.4)])[0])
    out = take_all(session)
    partial_requests = [request for request in engine.requests if request.partial]
    lengths = [len(request.audio) / 16000 for request in partial_requests]
    assert len(lengths) == 3  # at ~1, ~2, ~3 s of segment audio
    assert all(later - earlier >= 1.0 for earlier, later in zip(lengths, lengths[1:]))
    assert lengths[0] == pytest.approx(1.0, abs=0.1)
    assert {request.stream_id for request in partial_requests} == {"s/0"}
    assert all(request.context == "" and request.language is None for request in partial_requests)
    partials = [event for event in out if isinstance(event, events.Partial)]
    assert [p.end - p.start for p in partials] == pytest.approx(lengths)
    assert [p.text for p in partials] == [f"{length:.2f}s" for length in lengths]
    assert kinds(out)[0] == "speech_started"


def test_requests_carry_the_streams_context_and_language():
    session = Session("s", settings(context="Names: Qasr", language="German", partial_interval_ms=500))
    engine = Engine(session)
    feed(session, engine, speech_like(TWO_BURSTS)[0])
    assert {(request.context, request.language) for request in engine.requests} == {("Names: Qasr", "German")}
    assert {request.partial for request in engine.requests} == {True, False}


def test_at_most_one_partial_in_flight_and_the_next_one_follows_its_answer():
    session = Session("s", settings(partial_interval_ms=500))
    engine = Engine(session, auto=False)
    feed(session, engine, speech_like([("silence", 0.3), ("speech", 3.0)])[0])  # nobody answers the partial
    assert len(engine.requests) == 1 and session.num_in_flight == 1
    engine.answer(engine.requests[0])
    assert len(engine.requests) == 2  # overdue: asked at once, with all the audio so far
    assert len(engine.requests[1].audio) > len(engine.requests[0].audio)


def test_a_partial_in_flight_when_its_segment_closes_is_cancelled_and_never_sent():
    session = Session("s", settings(partial_interval_ms=500))
    engine = Engine(session, auto=False)
    feed(session, engine, speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.8)])[0])
    partial, final = engine.requests[0], engine.requests[-1]
    assert partial.partial and not final.partial
    assert engine.cancelled == [partial]
    session.on_result(partial.request_id, describe(partial))  # a late answer to a cancelled request is ignored
    engine.answer(final)
    session.end()
    engine.run()
    assert kinds(take_all(session)) == ["speech_started", "speech_ended", "final", "summary"]
    assert engine.released == ["s/0"]


def test_a_superseded_or_failed_partial_is_dropped_and_streaming_goes_on():
    session = Session("s", settings(partial_interval_ms=500))
    engine = Engine(session, auto=False)
    audio, _ = speech_like([("silence", 0.3), ("speech", 2.0)])
    feed(session, engine, audio[:16000])
    engine.answer(engine.pending(partial=True)[0], None)  # superseded by a newer partial in the engine
    feed(session, engine, audio[16000:24000])
    engine.answer(engine.pending(partial=True)[0], RuntimeError("boom"))
    feed(session, engine, audio[24000:])
    engine.answer(engine.pending(partial=True)[0])
    assert kinds(take_all(session)) == ["speech_started", "partial"]


def test_finals_are_sent_in_segment_order_even_when_decoded_out_of_order():
    session = Session("s", settings(partials=False))
    engine = Engine(session, auto=False)
    feed(session, engine, speech_like(TWO_BURSTS)[0])
    first, second = engine.pending(partial=False)
    engine.answer(second)
    before = take_all(session)
    engine.answer(first)
    session.end()
    after = take_all(session)
    assert "final" not in kinds(before)
    assert kinds(after) == ["final", "final", "summary"]
    assert [event.segment_id for event in after[:2]] == [0, 1]


def test_a_failed_final_still_gives_exactly_one_final_after_an_error_event():
    session = Session("s", settings(partials=False))
    engine = Engine(session, auto=False)
    feed(session, engine, speech_like(TWO_BURSTS)[0])
    first, second = engine.pending(partial=False)
    engine.answer(first, RuntimeError("CUDA went away"))
    engine.answer(second)
    session.end()
    out = take_all(session)
    assert kinds(out) == ["speech_started", "speech_ended", "speech_started", "speech_ended", "error", "final",
                          "final", "summary"]
    error, failed = out[4], out[5]
    assert error.code == "decode_failed" and not error.fatal and "CUDA" not in error.message
    assert failed.segment_id == 0 and failed.text == ""
    assert sorted(engine.released) == ["s/0", "s/1"]


def test_abort_cancels_engine_work_releases_streams_and_ends_the_events():
    session = Session("s", settings(partial_interval_ms=500))
    engine = Engine(session, auto=False)
    feed(session, engine, speech_like(TWO_BURSTS + [("speech", 1.5)])[0])
    assert session.num_in_flight == 3  # two finals and the open segment's partial
    cancelled_before = len(engine.cancelled)  # the closed segments' partials
    session.abort()
    session.abort()
    engine.run()
    assert session.num_in_flight == 0
    assert len(engine.cancelled) - cancelled_before == 3 and not engine.waiting
    assert not engine.streams and sorted(engine.released) == ["s/0", "s/1", "s/2"]
    assert session.take_event() is None
    with pytest.raises(RuntimeError):
        session.feed(np.zeros(160, np.float32))


def test_capacity_runs_out_while_too_many_finals_are_pending_or_untaken():
    session = Session("s", settings(partials=False), max_pending_finals=2)
    engine = Engine(session, auto=False)
    feed(session, engine, speech_like(TWO_BURSTS)[0])
    assert not session.has_capacity
    engine.answer(engine.pending(partial=False)[0])
    assert not session.has_capacity  # the final is made but not yet taken: it still counts against the client
    while not isinstance(session.take_event(), events.Final):
        pass
    assert session.has_capacity


def test_a_slow_reader_gets_the_newest_partial_not_a_backlog():
    session = Session("s", settings(partial_interval_ms=200))
    engine = Engine(session)
    feed(session, engine, speech_like([("silence", 0.3), ("speech", 6.0)])[0], chunk=800)  # nobody reads
    backlog = take_all(session)
    partials = [event for event in backlog if isinstance(event, events.Partial)]
    assert len(backlog) <= 8 + 1 and partials  # without the replacement: ~20 events (one partial per 200 ms)
    assert partials[-1].end == max(p.end for p in partials)  # the newest hypothesis is the one kept


def test_other_input_rates_are_resampled_and_timestamps_stay_true():
    session = Session("s", settings(sample_rate=48000, partials=False))
    engine = Engine(session)
    audio, truth = speech_like(TWO_BURSTS, sample_rate=48000)
    feed(session, engine, audio, chunk=4800)
    session.end()
    engine.run()
    out = take_all(session)
    finals = [event for event in out if isinstance(event, events.Final)]
    assert len(finals) == 2
    for final, (start, end) in zip(finals, truth):
        assert abs(final.start - start) < 0.1 and abs(final.end - end) < 0.1
    assert out[-1].audio_seconds == pytest.approx(4.2)


def test_several_channels_are_averaged_to_one():
    audio, truth = speech_like(TWO_BURSTS)
    stereo = np.stack([audio, np.zeros_like(audio)], axis=1)  # [frames, 2]: speech on the left only
    session = Session("s", settings(channels=2, partials=False))
    engine = Engine(session)
    feed(session, engine, stereo)
    with pytest.raises(ValueError, match="2 channels"):
        session.feed(np.zeros((10, 3), np.float32))
    session.end()
    out = take_all(session)
    assert [event.segment_id for event in out if isinstance(event, events.Final)] == [0, 1]
    assert out[-1].audio_seconds == pytest.approx(4.2)
    with pytest.raises(ValueError, match="one per channel"):
        Session("m", settings(channels=2, multichannel=True))


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

    recorder = Recorder()
    session = Session("s", settings(partial_interval_ms=500, vad=VadSettings()), observer=recorder,
                      clock=lambda: now[0])
    engine = Engine(session, auto=False)
    feed(session, engine, speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.8)])[0])
    now[0] += 0.25
    engine.answer(engine.pending(partial=False)[0])
    final = [event for event in take_all(session) if isinstance(event, events.Final)][0]
    assert final.latency_ms == pytest.approx(250.0)
    assert recorder.finals == [pytest.approx(0.25)] and recorder.segments == 1
