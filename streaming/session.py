"""One stream's life: PCM in, server events out, with the engine in between. No sockets.

A `Session` takes mono float32 PCM at the client's rate (`feed`), resamples it to 16 kHz, cuts it into speech
segments with the VAD, asks the engine for partials while a segment grows and for one final when it closes, and
queues the resulting events for `next_event()`. The connection handler only moves frames in and events out.

The ordering the client can rely on (tests/streaming/test_session.py checks each):
- a segment's `speech_started` comes before its partials, its partials before its `final`;
- every `speech_started` is followed by exactly one `final`, including the segment open at `end()`;
- finals come in segment order; `summary` is the last event, after every final;
- at most one partial is being decoded per session; a partial whose segment closed meanwhile is dropped.

Finals are emitted in segment order even if the engine finishes them out of order, so a later segment's
`speech_started`/`partial` may come before an earlier segment's `final`: clients key by `segment_id`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from qasr.model.audio import SAMPLE_RATE
from qasr.streaming import events, vad
from qasr.engine.request import DecodeRequest, DecodeResult, EngineClosed, Priority, Superseded
from qasr.streaming.resample import StreamResampler

log = logging.getLogger("qasr.session")
BACKLOG_EVENTS = 8  # unsent events beyond which a new partial replaces an unsent one of the same segment


class Engine(Protocol):
    """What a session needs of `qasr.engine.engine.AsyncEngine`."""

    async def transcribe(self, request: DecodeRequest) -> DecodeResult: ...

    def release_stream(self, stream_id: str) -> None: ...


class SessionObserver:
    """Hooks for metrics; every method is a no-op here. Latencies in seconds."""

    def segment_started(self) -> None: ...

    def partial_sent(self, latency_s: float) -> None: ...

    def final_sent(self, latency_s: float) -> None: ...

    def decode_failed(self, priority: Priority) -> None: ...

    def decoded(self, priority: Priority, timings: dict[str, float]) -> None:
        """Where one request's time went inside the engine (DecodeResult.timings, milliseconds)."""


@dataclass(frozen=True)
class SessionOptions:
    input_rate: int = SAMPLE_RATE  # Hz of the samples given to feed()
    language: str | None = None  # forced language (canonical name); None: the model detects it
    context: str = ""  # system prompt text for every decode of this stream
    partials: bool = True
    partial_interval_ms: int = 1000  # a partial is due after this much new segment audio
    vad: vad.VadOptions = vad.VadOptions()
    max_pending_finals: int = 16  # closed segments awaiting their final before wait_for_capacity() blocks

    def __post_init__(self):
        if self.partial_interval_ms <= 0:
            raise ValueError(f"partial_interval_ms must be > 0, got {self.partial_interval_ms}")
        if self.max_pending_finals < 1:
            raise ValueError(f"max_pending_finals must be >= 1, got {self.max_pending_finals}")

    @property
    def partial_interval_samples(self) -> int:
        return self.partial_interval_ms * SAMPLE_RATE // 1000


@dataclass
class _OpenSegment:
    segment_id: int
    start: int  # 16 kHz sample offset from the start of the stream
    stream_id: str
    partial_audio_samples: int = 0  # segment length when the last partial was requested
    raw_text: str = ""  # the last partial's raw output: the next partial's prefix (rolled back)


@dataclass
class _PartialJob:
    segment: _OpenSegment
    task: asyncio.Task | None = None


@dataclass
class _ClosedSegment:
    segment_id: int
    start: int  # 16 kHz samples
    end: int
    reason: str
    stream_id: str
    decided_at: float  # clock() when the segment's end was decided
    task: asyncio.Task | None = None
    result: tuple[str, str] | None = None  # (text, language) once the final decode is over
    error: events.Error | None = None  # set when the decode failed (the final then has empty text)


class Session:
    """One client stream. Call feed/flush/end from the event loop; take events with next_event()."""

    def __init__(self, engine: Engine, session_id: str, options: SessionOptions = SessionOptions(), *,
                 rollback: Callable[[str], str] | None = None, observer: SessionObserver | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """rollback(raw_text) -> the prefix for the next partial (e.g. rollback_prefix with the model's tokenizer);
        None: partials are decoded without a prefix."""
        self.engine = engine
        self.session_id = session_id
        self.options = options
        self._rollback = rollback
        self._observer = observer or SessionObserver()
        self._clock = clock

        self._resampler = StreamResampler(options.input_rate, SAMPLE_RATE)
        self._segmenter = vad.Segmenter(options.vad)
        self._segmenter_offset = 0  # 16 kHz offset of the current segmenter's sample 0 (it restarts at a flush)
        self._segment_id_offset = 0  # segment ids the earlier segmenters used up (each numbers from 0)
        self._next_segment_id = 0
        self._open: _OpenSegment | None = None
        self._partial: _PartialJob | None = None
        self._closing: collections.deque[_ClosedSegment] = collections.deque()  # awaiting their final, in order
        self._streams_in_engine: set[str] = set()  # stream ids that had work and are not released yet

        self._outbox: collections.deque[events.ServerEvent] = collections.deque()
        self._wakeup = asyncio.Event()  # something for next_event()
        self._capacity = asyncio.Event()  # fewer than max_pending_finals finals are pending or unsent
        self._capacity.set()
        self._unsent_finals = 0  # finals in the outbox, not yet taken by next_event()
        self._failure: BaseException | None = None
        self._ended = False  # end() called: no more input
        self._finished = False  # the summary is queued: no more events after it
        self._aborted = False

        self.num_finals = 0
        self.input_samples = 0  # at input_rate
        self.speech_samples = 0  # at 16 kHz, summed over finalised segments

    # -- input -----------------------------------------------------------------------------------------------

    def feed(self, samples: np.ndarray) -> None:
        """Take the next audio: [n] float32 mono at options.input_rate. Never blocks."""
        self._check_open()
        self.input_samples += len(samples)
        self._handle_vad_events(self._segmenter.feed(self._resampler.process(samples)))
        self._request_partial_if_due()

    def flush(self) -> None:
        """Close the open segment now (its final follows); the stream goes on."""
        self._check_open()
        self._finish_segmenter(reason="flush")
        self._resampler = StreamResampler(self.options.input_rate, SAMPLE_RATE)
        self._segmenter = vad.Segmenter(self.options.vad)

    def end(self) -> None:
        """No more audio: the open segment closes ("end"); the summary follows the last final."""
        if self._ended or self._aborted:
            return
        self._finish_segmenter(reason="end")
        self._ended = True
        self._emit_ready_finals()

    def _check_open(self) -> None:
        if self._ended or self._aborted:
            raise RuntimeError(f"session {self.session_id} has ended: no more audio")

    def _finish_segmenter(self, reason: str) -> None:
        """Drain the resampler and the VAD; whatever segment is open closes with `reason`."""
        tail_events = self._segmenter.feed(self._resampler.flush()) + self._segmenter.flush()
        self._handle_vad_events(tail_events, flush_reason=reason)
        self._segmenter_offset += self._segmenter.samples_received
        self._segment_id_offset = self._next_segment_id

    # -- VAD events ------------------------------------------------------------------------------------------

    def _handle_vad_events(self, vad_events: list[vad.Event], flush_reason: str = "flush") -> None:
        for event in vad_events:
            if isinstance(event, vad.SpeechStarted):
                self._on_speech_started(event)
            else:
                reason = flush_reason if event.reason == "flush" else event.reason
                self._on_segment_closed(event, reason)

    def _on_speech_started(self, event: vad.SpeechStarted) -> None:
        segment_id = self._segment_id_offset + event.segment_id
        self._next_segment_id = segment_id + 1
        start = self._segmenter_offset + event.start_sample
        self._open = _OpenSegment(segment_id, start, stream_id=f"{self.session_id}/{segment_id}")
        self._observer.segment_started()
        self._emit(events.SpeechStarted(segment_id, start / SAMPLE_RATE))

    def _on_segment_closed(self, event: vad.SegmentClosed, reason: str) -> None:
        segment, self._open = self._open, None
        if self._partial is not None and self._partial.segment is segment:
            self._cancel_partial()  # the final supersedes it
        closed = _ClosedSegment(segment.segment_id, segment.start, self._segmenter_offset + event.end_sample,
                                reason, segment.stream_id, decided_at=self._clock())
        self._closing.append(closed)
        self._update_capacity()
        request = DecodeRequest(audio=event.audio, context=self.options.context, language=self.options.language,
                                priority=Priority.FINAL, stream_id=segment.stream_id)
        closed.task = self._start(self._run_final(closed, request), segment.stream_id)

    # -- partials --------------------------------------------------------------------------------------------

    def _request_partial_if_due(self) -> None:
        segment = self._open
        if not self.options.partials or segment is None or self._partial is not None:
            return
        open_segment = self._segmenter.open_segment
        if open_segment is None:
            return
        num_samples = len(open_segment.audio)
        if num_samples - segment.partial_audio_samples < self.options.partial_interval_samples:
            return
        segment.partial_audio_samples = num_samples
        prefix = self._rollback(segment.raw_text) if self._rollback and segment.raw_text else ""
        # the open segment's audio is a snapshot view (vad.OpenSegment): later feeds never rewrite it, so no copy
        request = DecodeRequest(audio=open_segment.audio, context=self.options.context,
                                language=self.options.language, text_prefix=prefix, priority=Priority.PARTIAL,
                                stream_id=segment.stream_id)
        job = _PartialJob(segment)
        self._partial = job
        job.task = self._start(self._run_partial(job, request), segment.stream_id)

    async def _run_partial(self, job: _PartialJob, request: DecodeRequest) -> None:
        submitted_at = self._clock()
        try:
            result = await self.engine.transcribe(request)
        except Superseded:
            result = None
        except EngineClosed as error:
            self._fail(error)
            return
        except Exception:  # a failed partial is not worth an event: the final follows anyway
            log.warning("partial of %s failed", request.stream_id, exc_info=True)
            self._observer.decode_failed(Priority.PARTIAL)
            result = None
        if self._partial is not job:  # cancelled meanwhile, by a close or an abort
            return
        self._partial = None
        segment = job.segment
        if result is not None:
            self._observer.decoded(Priority.PARTIAL, result.timings)
        if result is not None and self._open is segment:
            segment.raw_text = result.raw_text
            end = segment.start + len(request.audio)
            self._observer.partial_sent(self._clock() - submitted_at)
            self._emit(events.Partial(segment.segment_id, result.text, result.language,
                                      segment.start / SAMPLE_RATE, end / SAMPLE_RATE))
        self._request_partial_if_due()

    def _cancel_partial(self) -> None:
        job, self._partial = self._partial, None
        if job is not None and job.task is not None:
            job.task.cancel()

    # -- finals ----------------------------------------------------------------------------------------------

    async def _run_final(self, closed: _ClosedSegment, request: DecodeRequest) -> None:
        try:
            result = await self.engine.transcribe(request)
            closed.result = (result.text, result.language)
        except EngineClosed as error:
            self._fail(error)
            return
        except Exception:
            log.error("final of %s failed", request.stream_id, exc_info=True)
            self._observer.decode_failed(Priority.FINAL)
            closed.result = ("", "")
            closed.error = events.Error("decode_failed", f"segment {closed.segment_id} could not be transcribed; "
                                                         "its final has empty text")
        else:
            self._observer.decoded(Priority.FINAL, result.timings)
        finally:
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
                                    closed.end / SAMPLE_RATE, closed.reason, round(latency_s * 1000.0, 3)))
        self._update_capacity()
        if self._ended and not self._closing and not self._finished:
            self._finished = True
            self._emit(self.summary())

    def summary(self) -> events.Summary:
        return events.Summary(segments=self.num_finals,
                              audio_seconds=self.input_samples / self.options.input_rate,
                              speech_seconds=self.speech_samples / SAMPLE_RATE)

    # -- output ----------------------------------------------------------------------------------------------

    def notify(self, error: events.Error) -> None:
        """Queue an error event from outside (e.g. a protocol notice) in order with the stream's own events."""
        self._emit(error)

    async def next_event(self) -> events.ServerEvent | None:
        """The next event, in order; None after the summary. Raises the engine's failure (e.g. EngineClosed)."""
        while True:
            if self._outbox:
                event = self._outbox.popleft()
                if isinstance(event, events.Final):
                    self._unsent_finals -= 1
                    self._update_capacity()
                return event
            if self._failure is not None:
                raise self._failure
            if self._finished or self._aborted:
                return None
            self._wakeup.clear()
            await self._wakeup.wait()

    async def wait_for_capacity(self) -> None:
        """Wait while too many closed segments await their final (backpressure on a client sending too fast)."""
        while not self._capacity.is_set() and self._failure is None and not self._aborted:
            await self._capacity.wait()
        if self._failure is not None:
            raise self._failure

    @property
    def finished(self) -> bool:
        """The summary has been queued (or the session aborted): no more events will be produced."""
        return self._finished or self._aborted

    @property
    def num_pending_finals(self) -> int:
        return len(self._closing)

    @property
    def num_tasks(self) -> int:
        """Engine calls still running for this session."""
        tasks = [closed.task for closed in self._closing]
        if self._partial is not None:
            tasks.append(self._partial.task)
        return sum(1 for task in tasks if task is not None and not task.done())

    # -- teardown --------------------------------------------------------------------------------------------

    async def abort(self) -> None:
        """Stop now (the client is gone or the connection failed): cancel engine work, release every stream,
        drop buffers. Idempotent; no event is produced after it."""
        if self._aborted:
            return
        self._aborted = True
        tasks = [closed.task for closed in self._closing if closed.task is not None]
        if self._partial is not None and self._partial.task is not None:
            tasks.append(self._partial.task)
        self._partial = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for stream_id in list(self._streams_in_engine):
            self._release(stream_id)
        self._closing.clear()
        self._outbox.clear()
        self._open = None
        self._segmenter = self._resampler = None
        self._wakeup.set()
        self._capacity.set()

    # -- helpers ---------------------------------------------------------------------------------------------

    def _start(self, coroutine, stream_id: str) -> asyncio.Task:
        self._streams_in_engine.add(stream_id)  # released after its final, or by abort()
        return asyncio.get_running_loop().create_task(coroutine)

    def _release(self, stream_id: str) -> None:
        if stream_id not in self._streams_in_engine:
            return
        self._streams_in_engine.discard(stream_id)
        try:
            self.engine.release_stream(stream_id)
        except Exception:  # releasing is best effort: never let it break the stream
            log.warning("release_stream(%s) failed", stream_id, exc_info=True)

    def _emit(self, event: events.ServerEvent) -> None:
        if self._aborted:
            return
        last = self._outbox[-1] if self._outbox else None
        if isinstance(event, events.Partial) and isinstance(last, events.Partial) \
                and last.segment_id == event.segment_id and len(self._outbox) >= BACKLOG_EVENTS:
            self._outbox[-1] = event  # a reader that fell behind gets the newest hypothesis, not a backlog
        else:
            self._outbox.append(event)
        if isinstance(event, events.Final):
            self._unsent_finals += 1
        self._wakeup.set()

    def _update_capacity(self) -> None:
        """Backpressure: reading pauses while max_pending_finals finals are being decoded or not yet sent, so a
        client that sends fast and reads slowly cannot make the outbox grow without bound."""
        if len(self._closing) + self._unsent_finals >= self.options.max_pending_finals:
            self._capacity.clear()
        else:
            self._capacity.set()

    def _fail(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
        self._wakeup.set()
        self._capacity.set()
