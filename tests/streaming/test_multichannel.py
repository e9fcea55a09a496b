"""MultichannelSession, sans-I/O: one Session per channel behind one face. Each channel's speech is segmented on its
own and its events carry the channel; request ids from all channels share one space; one summary covers them all.
The test plays the engine (transcripts say how much audio they heard), as tests/streaming/test_session.py does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qasr.streaming import events
from qasr.streaming.multichannel import MultichannelSession
from qasr.streaming.session import Cancel, Decode, Release
from qasr.streaming.settings import StreamLimits, StreamSettings, VadSettings

# tests/ is on sys.path (tests/conftest.py)
from fakes import speech_like

EXACT_VAD = VadSettings(pre_roll_ms=0)  # segments start at the first voiced frame: comparable to the truth
TOLERANCE_S = 0.1
# different speech on each channel: two short turns on the left, one long one on the right, overlapping
LEFT = [("silence", 0.5), ("speech", 1.2), ("silence", 1.0), ("speech", 0.7), ("silence", 1.1)]
RIGHT = [("silence", 1.0), ("speech", 2.0), ("silence", 1.5)]


def stereo_settings(**fields) -> StreamSettings:
    return dataclasses.replace(StreamSettings(vad=EXACT_VAD, partial_interval_ms=500, channels=2,
                                              multichannel=True), **fields)


def stereo() -> tuple[np.ndarray, list[list[tuple[float, float]]]]:
    left, left_truth = speech_like(LEFT, seed=1)
    right, right_truth = speech_like(RIGHT, seed=2)
    assert len(left) == len(right)
    return np.stack([left, right], axis=1), [left_truth, right_truth]


@dataclasses.dataclass(frozen=True)
class Transcript:
    text: str
    language: str = "English"


class Engine:
    """Runs the session's actions; answers every Decode at once (auto) or when told."""

    def __init__(self, session: MultichannelSession, *, auto: bool = True):
        self.session = session
        self.auto = auto
        self.requests: list[Decode] = []
        self.waiting: dict[int, Decode] = {}
        self.cancelled: list[Decode] = []
        self.released: list[str] = []

    def run(self) -> None:
        while actions := self.session.take_actions():
            for action in actions:
                if isinstance(action, Decode):
                    assert action.request_id not in self.waiting, "request ids must be unique across channels"
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

    def answer(self, request: Decode) -> None:
        del self.waiting[request.request_id]
        self.session.on_result(request.request_id, Transcript(f"{len(request.audio) / 16000:.2f}s"))
        self.run()


def feed(session: MultichannelSession, engine: Engine, audio: np.ndarray, chunk: int = 1600) -> None:
    for start in range(0, len(audio), chunk):
        session.feed(audio[start:start + chunk])
        engine.run()


def take_all(session: MultichannelSession) -> list:
    out = []
    while (event := session.take_event()) is not None:
        out.append(event)
    return out


def test_each_channel_is_segmented_on_its_own_and_its_events_carry_the_channel():
    audio, truth = stereo()
    session = MultichannelSession("s", stereo_settings())
    engine = Engine(session)
    feed(session, engine, audio)
    session.end()
    engine.run()
    out = take_all(session)

    assert isinstance(out[-1], events.Summary) and not any(isinstance(event, events.Summary) for event in out[:-1])
    for channel in (0, 1):
        started = [event for event in out if isinstance(event, events.SpeechStarted) and event.channel == channel]
        finals = [event for event in out if isinstance(event, events.Final) and event.channel == channel]
        partials = [event for event in out if isinstance(event, events.Partial) and event.channel == channel]
        assert [event.segment_id for event in started] == [event.segment_id for event in finals] \
            == list(range(len(truth[channel])))  # exactly one final per segment, numbered per channel
        for final, (start, end) in zip(finals, truth[channel]):
            assert abs(final.start - start) < TOLERANCE_S and abs(final.end - end) < TOLERANCE_S
            assert final.text == f"{final.end - final.start:.2f}s"  # decoded from this channel's segment only
        assert partials, "partials while each channel's segment grows"
        for partial in partials:  # before their own segment's final
            final_index = out.index(finals[partial.segment_id])
            assert out.index(partial) < final_index
    assert all(event.channel in (0, 1) for event in out if not isinstance(event, events.Summary))
    summary = out[-1]
    assert summary.segments == 3
    assert summary.audio_seconds == pytest.approx(len(audio) / 16000)  # the stream's length, once
    speech = sum(event.end - event.start for event in out if isinstance(event, events.Final))
    assert summary.speech_seconds == pytest.approx(speech, abs=1e-6)
    assert session.summary() == summary
    streams = {request.stream_id for request in engine.requests}
    assert {"s.0/0", "s.0/1", "s.1/0"} == streams and set(engine.released) == streams


def test_flush_of_one_channel_closes_only_its_segment():
    audio, _ = stereo()
    session = MultichannelSession("s", stereo_settings(partials=False))
    engine = Engine(session)
    feed(session, engine, audio[:int(1.5 * 16000)])  # both channels are speaking at 1.5 s
    take_all(session)
    session.flush(1)
    engine.run()
    out = take_all(session)
    assert [(type(event).__name__, event.channel) for event in out] == [("SpeechEnded", 1), ("Final", 1)]
    assert out[-1].reason == "flush"
    session.flush()  # every channel: channel 0's open segment now
    engine.run()
    assert [(type(event).__name__, event.channel) for event in take_all(session)] == \
        [("SpeechEnded", 0), ("Final", 0)]
    with pytest.raises(ValueError, match="channel 2"):
        session.flush(2)


def test_backpressure_counts_every_channel():
    audio, _ = stereo()
    session = MultichannelSession("s", stereo_settings(partials=False), max_pending_finals=1)
    engine = Engine(session, auto=False)
    feed(session, engine, audio[:int(1.5 * 16000)])
    assert session.has_capacity
    session.flush(1)
    engine.run()
    assert not session.has_capacity  # channel 1's final is being decoded
    engine.answer(next(iter(engine.waiting.values())))
    assert not session.has_capacity  # and now waits to be taken
    assert [type(event).__name__ for event in take_all(session)] == ["SpeechStarted", "SpeechStarted",
                                                                     "SpeechEnded", "Final"]
    assert session.has_capacity


def test_abort_cancels_and_releases_every_channel():
    audio, _ = stereo()
    session = MultichannelSession("s", stereo_settings(partial_interval_ms=200), max_pending_finals=4)
    engine = Engine(session, auto=False)
    feed(session, engine, audio[:int(1.5 * 16000)])
    session.flush(0)
    engine.run()
    in_flight, cancelled_before = set(engine.waiting), len(engine.cancelled)
    assert session.num_in_flight == len(in_flight) >= 2  # channel 0's final and channel 1's partial
    session.abort()
    engine.run()
    assert {request.request_id for request in engine.cancelled[cancelled_before:]} == in_flight
    assert not engine.waiting
    assert set(engine.released) == {request.stream_id for request in engine.requests}
    assert session.take_event() is None


def test_outcomes_of_answered_or_unknown_requests_are_ignored():
    audio, _ = stereo()
    session = MultichannelSession("s", stereo_settings())
    engine = Engine(session)
    feed(session, engine, audio)
    answered = engine.requests[0].request_id
    before = len(take_all(session))
    session.on_result(answered, Transcript("late"))
    session.on_result(10_000, Transcript("unknown"))
    assert before and session.take_event() is None


def test_settings_and_shapes():
    StreamLimits().check(stereo_settings())  # the limits accept multichannel streams
    with pytest.raises(ValueError, match="multichannel"):
        MultichannelSession("s", StreamSettings(channels=2))
    session = MultichannelSession("s", stereo_settings())
    with pytest.raises(ValueError, match=r"\[frames, 2\]"):
        session.feed(np.zeros(160, np.float32))
    with pytest.raises(ValueError, match=r"\[frames, 2\]"):
        session.feed(np.zeros((160, 3), np.float32))
