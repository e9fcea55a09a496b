"""One stream's policy, sans-I/O: audio in -> events and engine work out; engine results in -> events out.

A `Session` takes the client's PCM (`feed`), resamples it to 16 kHz, cuts it into speech segments with the VAD,
decides when a partial is due while a segment grows and asks for one final when it closes. It never awaits
anything: what the engine should do is queued as actions (`take_actions()`: Decode, Cancel, Release), and whoever
runs them (qasr.server.stream_runner) hands each outcome back with `on_result(request_id, result)`. Events for the
client are taken with `take_event()`.

The ordering the client can rely on (tests/streaming/test_session.py checks each):
- a segment's `speech_started` comes before its partials, its partials before its `final`;
- every `speech_started` is followed by exactly one `final`, including the segment open at `end()`;
- finals come in segment order; `summary` is the last event, after every final;
- at most one partial is being decoded per session; a partial whose segment closed meanwhile is dropped.

Finals are emitted in segment order even if the engine finishes them out of order, so a later segment's
`speech_started`/`partial` may come before an earlier segment's `final`: clients key by `segment_id`. Each segment's
`speech_ended` (internal: the VAD closed it) comes right before the request for its final.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Union

import numpy as np

from qasr.audio import SAMPLE_RATE, downmix
from qasr.streaming import events, vad
from qasr.streaming.outbox import EventOutbox
from qasr.streaming.resample import StreamResampler
from qasr.streaming.settings import StreamSettings



# -- what the session asks of the engine -------------------------------------------------------------------------


@dataclass(frozen=True)
class Decode:
    """Transcribe `audio`; answer with on_result(request_id, ...)."""

    request_id: int
    stream_id: str  # "{session_id}/{segment_id}": the engine keeps per-stream state (encoder windows, rollback)
    audio: np.ndarray = field(repr=False, compare=False)  # 16 kHz float32 mono: the segment (so far, if partial)
    partial: bool  # a hypothesis while the segment grows (the engine may supersede it) or the segment's final
    context: str
    language: str | None
    words: bool = False  # a final of a stream that asked for word times (the result's are clip-relative)


@dataclass(frozen=True)
class Cancel:
    """The session no longer wants this request's outcome (its segment closed, or the session aborted)."""

    request_id: int


@dataclass(frozen=True)
class Release:
    """The engine may forget what it keeps for this stream: its final is done (or the session aborted)."""

    stream_id: str


EngineAction = Union[Decode, Cancel, Release]


class SessionObserver:
    """Hooks for metrics; every method is a no-op here. Latencies in seconds."""

    def segment_started(self) -> None: ...

    def partial_sent(self, latency_s: float) -> None: ...

    def final_sent(self, latency_s: float) -> None: ...


# -- per-segment state --------------------------------------------------------------------------------------------


@dataclass
class _OpenSegment:
    segment_id: int
    start: int  # 16 kHz sample offset from the start of the stream
    stream_id: str
    partial_audio_samples: int = 0  # segment length when the last partial was requested


@dataclass
class _PartialJob:
    request_id: int
    segment: _OpenSegment
    num_samples: int  # the audio it heard
    submitted_at: float  # clock()


@dataclass
class _ClosedSegment:
    segment_id: int
    start: int  # 16 kHz samples
    end: int
    reason: str
    stream_id: str
    request_id: int
    decided_at: float  # clock() when the segment's end was decided
    result: tuple[str, str] | None = None  # (text, language) once the final decode is over
    error: events.Error | None = None  # set when the decode failed (the final then has empty text)
    words: tuple[events.Word, ...] | None = None  # stream time; only when the stream asked for words
    words_reason: str | None = None


class Session:
    """One client stream's policy. Nothing here blocks, awaits or touches the engine."""

    def __init__(self, session_id: str, settings: StreamSettings = StreamSettings(), *, max_pending_finals: int = 16,
                 observer: SessionObserver | None = None, clock: Callable[[], float] = time.monotonic):
        """max_pending_finals: closed segments awaiting their final or not yet taken, beyond which
        `has_capacity` turns False (the caller then stops reading audio)."""
        if settings.multichannel:
            raise ValueError("a Session hears one channel: run one per channel for multichannel streams")
        if max_pending_finals < 1:
            raise ValueError(f"max_pending_finals must be >= 1, got {max_pending_finals}")
        self.session_id = session_id
        self.settings = settings
        self.max_pending_finals = max_pending_finals
        self._observer = observer or SessionObserver()
        self._clock = clock
        self._partial_interval_samples = settings.partial_interval_ms * SAMPLE_RATE // 1000

        self._resampler = StreamResampler(settings.sample_rate, SAMPLE_RATE)
        self._segmenter = vad.Segmenter(settings.vad)
        self._request_ids = itertools.count()
        self._open: _OpenSegment | None = None
        self._partial: _PartialJob | None = None
        self._closing: collections.deque[_ClosedSegment] = collections.deque()  # awaiting their final, in order
        self._streams_in_engine: set[str] = set()  # stream ids that had work and are not released yet

        self._actions: list[EngineAction] = []
        self._outbox = EventOutbox()
        self._ended = False  # end() called: no more input
        self._summarised = False
        self._aborted = False

        self.num_finals = 0
        self.input_samples = 0  # frames at settings.sample_rate
        self.speech_samples = 0  # at 16 kHz, summed over finalised segments

    # -- input -------------------------------------------------------------------------------------------------

    def feed(self, samples: np.ndarray) -> None:
        """Take the next audio: float32 [frames, channels] (or [frames] when mono) at settings.sample_rate."""
        self._check_open()
        samples = np.asarray(samples)
        if samples.ndim == 2:
            if samples.shape[1] != self.settings.channels:
                raise ValueError(f"expected {self.settings.channels} channels, got samples of shape {samples.shape}")
            samples = downmix(samples)
        elif self.settings.channels != 1:
            raise ValueError(f"expected [frames, {self.settings.channels}] samples, got shape {samples.shape}")
        self.input_samples += len(samples)
        self._handle_vad_events(self._segmenter.feed(self._resampler.process(samples)))
        self._request_partial_if_due()

    def flush(self) -> None:
        """Close the open segment now (reason "flush"; its final follows). The stream, its timeline and its
        segment numbering go on: the same segmenter continues."""
        self._check_open()
        self._handle_vad_events(self._segmenter.end_segment())

    def end(self) -> None:
        """No more audio: the open segment closes ("end"); the summary follows the last final."""
        if self._ended or self._aborted:
            return
        tail = self._segmenter.feed(self._resampler.flush()) + self._segmenter.flush()
        self._handle_vad_events(tail, flush_reason="end")
        self._ended = True
        self._emit_ready_finals()

    def notify(self, event) -> None:
        """Queue an event from outside (an error for a protocol notice; a wire adapter's reply, which the connection
        sends as it is) in order with the stream's own events."""
        self._emit(event)

    def _check_open(self) -> None:
        if self._ended or self._aborted:
            raise RuntimeError(f"session {self.session_id} has ended: no more audio")

    # -- engine work ---------------------------------------------------------------------------------------------

    def take_actions(self) -> list[EngineAction]:
        """What the engine should do now, in order; each Decode is answered later through on_result."""
        actions, self._actions = self._actions, []
        return actions

    def on_result(self, request_id: int, result) -> None:
        """The outcome of a Decode: a transcript (anything with `text` and `language`, e.g. DecodeResult), None when
        the engine dropped the request (a newer partial superseded it), or the exception it failed with. Outcomes
        of cancelled requests are ignored."""
        if self._aborted:
            return
        if self._partial is not None and self._partial.request_id == request_id:
            self._on_partial_result(self._partial, result)
            return
        for closed in self._closing:
            if closed.request_id == request_id and closed.result is None:
                self._on_final_result(closed, result)
                return

    def abort(self) -> None:
        """Stop now (the client is gone or the connection failed): cancel engine work, release every stream, drop
        buffers and events. Idempotent; nothing is produced after it but the Cancel and Release actions."""
        if self._aborted:
            return
        self._aborted = True
        pending = [closed.request_id for closed in self._closing if closed.result is None]
        if self._partial is not None:
            pending.append(self._partial.request_id)
        self._actions += [Cancel(request_id) for request_id in pending]
        self._actions += [Release(stream_id) for stream_id in sorted(self._streams_in_engine)]
        self._streams_in_engine.clear()
        self._partial = self._open = None
        self._closing.clear()
        self._outbox.clear()
        self._segmenter = self._resampler = None

    # -- output --------------------------------------------------------------------------------------------------

    def take_event(self) -> events.ServerEvent | None:
        """The next event for the client, in order; None when there is none now."""
        return self._outbox.take()

    @property
    def has_capacity(self) -> bool:
        """False while max_pending_finals finals are being decoded or not yet taken: a client that sends fast and
        reads slowly must be paused, or the events would pile up without bound."""
        return len(self._closing) + self._outbox.num_finals < self.max_pending_finals

    @property
    def num_in_flight(self) -> int:
        """Decodes asked for and not answered (nor cancelled)."""
        return sum(closed.result is None for closed in self._closing) + (self._partial is not None)

    def summary(self) -> events.Summary:
        return events.Summary(segments=self.num_finals, audio_seconds=self.input_samples / self.settings.sample_rate,
                              speech_seconds=self.speech_samples / SAMPLE_RATE)

    # -- VAD events ----------------------------------------------------------------------------------------------

    def _handle_vad_events(self, vad_events: list[vad.Event], flush_reason: str = "flush") -> None:
        for event in vad_events:
            if isinstance(event, vad.SpeechStarted):
                self._on_speech_started(event)
            else:
                self._on_segment_closed(event, flush_reason if event.reason == "flush" else event.reason)

    def _on_speech_started(self, event: vad.SpeechStarted) -> None:
        stream_id = f"{self.session_id}/{event.segment_id}"
        self._open = _OpenSegment(event.segment_id, event.start_sample, stream_id)
        self._observer.segment_started()
        self._emit(events.SpeechStarted(event.segment_id, event.start_sample / SAMPLE_RATE))

    def _on_segment_closed(self, event: vad.SegmentClosed, reason: str) -> None:
        segment, self._open = self._open, None
        if self._partial is not None and self._partial.segment is segment:
            self._actions.append(Cancel(self._partial.request_id))  # the final supersedes it
            self._partial = None
        self._emit(events.SpeechEnded(segment.segment_id, event.end_sample / SAMPLE_RATE))
        request = self._decode(segment.stream_id, event.audio, partial=False, words=self.settings.words)
        self._closing.append(_ClosedSegment(segment.segment_id, segment.start, event.end_sample, reason,
                                            segment.stream_id, request.request_id, decided_at=self._clock()))

    # -- partials ------------------------------------------------------------------------------------------------

    def _request_partial_if_due(self) -> None:
        segment = self._open
        if not self.settings.partials or segment is None or self._partial is not None:
            return
        open_segment = self._segmenter.open_segment
        if open_segment is None:
            return
        num_samples = len(open_segment.audio)
        if num_samples - segment.partial_audio_samples < self._partial_interval_samples:
            return
        segment.partial_audio_samples = num_samples
        # the open segment's audio is a snapshot view (vad.OpenSegment): later feeds never rewrite it, so no copy
        request = self._decode(segment.stream_id, open_segment.audio, partial=True)
        self._partial = _PartialJob(request.request_id, segment, num_samples, submitted_at=self._clock())

    def _on_partial_result(self, job: _PartialJob, result) -> None:
        self._partial = None
        segment = job.segment
        if result is not None and not isinstance(result, BaseException) and self._open is segment:
            self._observer.partial_sent(self._clock() - job.submitted_at)
            self._emit(events.Partial(segment.segment_id, result.text, result.language, segment.start / SAMPLE_RATE,
                                      (segment.start + job.num_samples) / SAMPLE_RATE))
        # a dropped or failed partial is not worth an event: the next one (or the final) follows
        self._request_partial_if_due()

    # -- finals --------------------------------------------------------------------------------------------------

    def _on_final_result(self, closed: _ClosedSegment, result) -> None:
        if result is None or isinstance(result, BaseException):
            closed.result = ("", "")
            closed.error = events.Error("decode_failed", f"segment {closed.segment_id} could not be transcribed; "
                                                         "its final has empty text")
        else:
            closed.result = (result.text, result.language)
        if self.settings.words:
            closed.words, closed.words_reason = _stream_words(closed, result)
        self._release(closed.stream_id)
        self._emit_ready_finals()

    def _emit_ready_finals(self) -> None:
        """Hand out the finals that are done, in segment order; the summary after the last one."""
        while self._closing and self._closing[0].result is not None:
            closed = self._closing.popleft()
            if closed.error is not None:
                self._emit(closed.error)
            text, language = closed.result
            latency_s = self._clock() - closed.decided_at
            self.num_finals += 1
            self.speech_samples += closed.end - closed.start
            self._observer.final_sent(latency_s)
            self._emit(events.Final(closed.segment_id, text, language, closed.start / SAMPLE_RATE,
                                    closed.end / SAMPLE_RATE, closed.reason, round(latency_s * 1000.0, 3),
                                    words=closed.words, words_reason=closed.words_reason))
        if self._ended and not self._closing and not self._summarised:
            self._summarised = True
            self._emit(self.summary())

    # -- helpers -------------------------------------------------------------------------------------------------

    def _decode(self, stream_id: str, audio: np.ndarray, *, partial: bool, words: bool = False) -> Decode:
        request = Decode(next(self._request_ids), stream_id, audio, partial, self.settings.context,
                         self.settings.language, words)
        self._streams_in_engine.add(stream_id)  # released after its final, or by abort()
        self._actions.append(request)
        return request

    def _release(self, stream_id: str) -> None:
        if stream_id in self._streams_in_engine:
            self._streams_in_engine.discard(stream_id)
            self._actions.append(Release(stream_id))

    def _emit(self, event: events.ServerEvent) -> None:
        if self._aborted:
            return
        self._outbox.put(event)


def _stream_words(closed: _ClosedSegment, result) -> tuple[tuple[events.Word, ...], str | None]:
    """A final's word times in stream time (the engine's are from the start of the segment's audio), or why none."""
    if closed.error is not None:
        return (), "the segment could not be transcribed"
    words = getattr(result, "words", None)
    if words is None:
        return (), getattr(result, "words_reason", None) or "the engine gave no word times"
    offset, first, last = closed.start / SAMPLE_RATE, closed.start / SAMPLE_RATE, closed.end / SAMPLE_RATE

    def at(seconds: float) -> float:  # to the ms, and never outside the segment for the rounding
        return min(max(round(offset + seconds, 3), first), last)

    timed = tuple(events.Word(word, at(start), at(end)) for word, start, end in words)
    return timed, (None if timed else result.words_reason)
