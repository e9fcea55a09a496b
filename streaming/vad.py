"""Sans-I/O voice-activity segmenter: 16 kHz float32 PCM in, speech-segment events out.

`Segmenter.feed(samples)` accepts pieces of any length and returns the events they caused;
`Segmenter.end_segment()` closes the open segment now (a client's flush) and the stream goes on;
`Segmenter.flush()` ends the stream. No clock, no socket, no thread: the same samples always give
the same events, however they are cut into pieces.

How a stream is cut (start_ms, end_silence_ms and min_segment_ms count whole frames, rounded up):

    frames     ..........1111111111.11111111............111111...
                         ^ start_ms of consecutive voiced frames opens a segment
               <pre_roll>  (audio kept before the first voiced frame)
                                           ^ end of speech + hangover_ms = end_sample
                                           <-- end_silence_ms --> closes the segment

- The end of speech is the end of the last voiced frame, less webrtcvad's own overhang: the VAD
  keeps saying "speech" for up to ~150 ms after speech stops, so trailing frames that are no louder
  than the silence which closed the segment are given back before `hangover_ms` (default 50) is added.
- Opening uses consecutive frames (`start_ms` of them, default 150 ms) rather than "k of n": webrtcvad
  says "speech" for its first ~100 ms of any noisy stream while its noise model settles, and a run
  requirement longer than that start-up blip is the simplest filter that keeps onsets sharp.
- Once open, any voiced frame keeps the segment alive; `end_silence_ms` of unvoiced frames closes it.
- A segment never grows past `max_segment_s`: it is cut at the quietest point of its last
  `cut_window_s`, but never in its first 3/4 of `max_segment_s` (so a cut leaves a segment of useful
  length, never a sliver of the pre-roll), and the rest continues at once as the next segment
  (next start == previous end).
- The pre-roll is clamped to a quarter of `max_segment_s` (a 2 s segment keeps at most 500 ms of it).
- `min_segment_ms` holds back the announcement of a segment until it has that much voiced audio.
  A blip that falls silent earlier was never announced and leaves no event. Once `SpeechStarted`
  has been emitted, the segment always ends with exactly one `SegmentClosed`.

Timestamps are sample offsets from the first sample fed. The audio of a closed segment is exactly
`stream[start_sample:end_sample]`; segments never overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Union

import numpy as np
import webrtcvad

from qasr.audio import SAMPLE_RATE, quietest_point
from qasr.streaming.resample import as_float32_mono
from qasr.streaming.settings import VadSettings

SAMPLES_PER_MS = SAMPLE_RATE // 1000  # 16; the segmenter's only input rate is SAMPLE_RATE (resample first)

# frame: [frame_samples] float32 in [-1, 1] -> is it speech? Stateful; one instance per stream.
FrameClassifier = Callable[[np.ndarray], bool]
# the same for consecutive frames at once: [n, frame_samples] -> n decisions (what the segmenter calls)
FramesClassifier = Callable[[np.ndarray], list[bool]]

CloseReason = Literal["silence", "max_length", "flush"]

# webrtcvad's internal overhang lasts at most 14 x 10 ms, 7 x 20 ms or 5 x 30 ms frames (vad_core.c).
_MAX_OVERHANG_MS = 150
_OVERHANG_FLOOR_RATIO = 3.0  # a trailing frame this close to the noise floor (~5 dB) is not speech
_MIN_FLOOR_FRAMES = 3  # unvoiced frames needed to trust a noise-floor estimate
MIN_CUT_FRACTION = 0.75  # a max-length cut leaves a segment of at least this share of max_segment_s
MAX_PRE_ROLL_FRACTION = 0.25  # pre-roll is clamped to this share of max_segment_s


@dataclass(frozen=True)
class SpeechStarted:
    """A segment opened. Its audio so far is `Segmenter.open_segment.audio`."""

    segment_id: int  # 0, 1, 2, ... per stream
    start_sample: int  # includes the pre-roll; never before the previous segment's end


@dataclass(frozen=True)
class SegmentClosed:
    """A segment ended; `audio` is exactly stream[start_sample:end_sample] (read-only, owned by the event)."""

    segment_id: int
    start_sample: int
    end_sample: int  # exclusive
    audio: np.ndarray = field(repr=False, compare=False)  # [end_sample - start_sample] float32
    reason: CloseReason  # "silence" | "max_length" | "flush"

    @property
    def num_samples(self) -> int:
        return self.end_sample - self.start_sample


Event = Union[SpeechStarted, SegmentClosed]


@dataclass(frozen=True)
class OpenSegment:
    """A read-only look at the segment being spoken. `audio` is a zero-copy view: later feeds never
    rewrite samples already handed out, so it stays a valid snapshot."""

    segment_id: int
    start_sample: int
    audio: np.ndarray = field(repr=False, compare=False)  # [samples_received - start_sample] float32


def webrtc_frames_classifier(aggressiveness: int) -> FramesClassifier:
    """The default classifier: webrtcvad at 16 kHz. The float frames of one feed become int16 in one pass (per
    frame, those numpy calls cost more than webrtcvad itself: a server runs this ~33 times a second per stream)."""
    vad = webrtcvad.Vad(aggressiveness)

    def is_speech(frames: np.ndarray) -> list[bool]:
        pcm16 = np.rint(np.clip(frames, -1.0, 1.0) * 32767.0).astype(np.int16).tobytes()
        step = 2 * frames.shape[1]
        return [vad.is_speech(pcm16[i : i + step], SAMPLE_RATE) for i in range(0, len(pcm16), step)]

    return is_speech


class _SampleBuffer:
    """stream[offset:end] in one growing float32 array: amortised O(1) appends and front drops."""

    def __init__(self) -> None:
        self._data = np.empty(1 << 14, dtype=np.float32)
        self._length = 0
        self.offset = 0  # stream index of _data[0]

    @property
    def end(self) -> int:
        return self.offset + self._length

    @property
    def num_retained(self) -> int:
        return self._length

    def append(self, samples: np.ndarray) -> None:
        needed = self._length + len(samples)
        if needed > len(self._data):
            grown = np.empty(max(needed, 2 * len(self._data)), dtype=np.float32)
            grown[: self._length] = self._data[: self._length]
            self._data = grown
        self._data[self._length : needed] = samples
        self._length = needed

    def view(self, start: int, stop: int) -> np.ndarray:
        """stream[start:stop] without copying, read-only."""
        if not self.offset <= start <= stop <= self.end:
            raise IndexError(f"stream[{start}:{stop}] is not retained (have [{self.offset}:{self.end}])")
        out = self._data[start - self.offset : stop - self.offset]
        out.flags.writeable = False
        return out

    def discard_before(self, sample: int) -> None:
        """Forget stream[:sample]. Compacts into a fresh array (earlier views stay intact) only when
        at least half the retained samples go, so the copying stays linear in the stream length."""
        drop = min(sample, self.end) - self.offset
        if drop <= 0 or 2 * drop < self._length:
            return
        keep = self._length - drop
        fresh = np.empty(max(1 << 14, 2 * keep), dtype=np.float32)
        fresh[:keep] = self._data[drop : self._length]
        self._data, self._length, self.offset = fresh, keep, self.offset + drop


@dataclass
class _Segment:
    """Mutable state of the segment being spoken (or, before it has min_segment_ms voiced, a candidate)."""

    segment_id: int
    start_sample: int
    last_voiced_end: int  # end of the latest voiced frame
    num_voiced_frames: int
    announced: bool = False  # SpeechStarted emitted


class Segmenter:
    """Cuts one 16 kHz float32 mono stream into speech segments. One instance per stream."""

    def __init__(self, settings: VadSettings = VadSettings(), *, frame_ms: int = 30, start_ms: int = 150,
                 hangover_ms: int = 50, cut_window_s: float = 3.0, min_segment_ms: int = 0,
                 classify_frame: FrameClassifier | None = None) -> None:
        """settings: what a client may choose (validated there). The keyword arguments tune the detector itself;
        their defaults suit conversational speech:

        frame_ms        webrtcvad frame: 10, 20 or 30 ms
        start_ms        consecutive voiced audio that opens a segment (> webrtcvad's ~100 ms start-up blip)
        hangover_ms     audio kept after the speech ends (soft word endings); <= settings.end_silence_ms
        cut_window_s    a max-length cut is searched in this last stretch of the segment (and never in its first
                        MIN_CUT_FRACTION of max_segment_s)
        min_segment_ms  voiced audio a segment needs before it is announced; 0 = no minimum
        """
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"Segmenter: {message}")

        require(frame_ms in (10, 20, 30), f"frame_ms must be 10, 20 or 30 (webrtcvad), got {frame_ms!r}")
        require(start_ms > 0, f"start_ms must be > 0, got {start_ms!r}")
        require(0 <= hangover_ms <= settings.end_silence_ms,
                f"hangover_ms must be in 0..end_silence_ms ({settings.end_silence_ms}), got {hangover_ms!r}")
        require(cut_window_s >= 0.1, f"cut_window_s must be >= 0.1 s, got {cut_window_s!r}")
        require(min_segment_ms >= 0, f"min_segment_ms must be >= 0, got {min_segment_ms!r}")
        require(start_ms + frame_ms <= settings.max_segment_s * 1000 / 2,
                f"start_ms + frame_ms ({start_ms + frame_ms} ms) must fit in half of max_segment_s")
        self.settings = settings
        self.frame_ms = frame_ms
        # sizes in frames or samples (time options round up to whole frames where frames count)
        self.frame_samples = frame_ms * SAMPLES_PER_MS
        self.start_frames = math.ceil(start_ms / frame_ms)
        self.end_frames = math.ceil(settings.end_silence_ms / frame_ms)
        self.min_segment_frames = math.ceil(min_segment_ms / frame_ms)
        self.hangover_samples = hangover_ms * SAMPLES_PER_MS
        self.max_segment_samples = round(settings.max_segment_s * SAMPLE_RATE)
        # A long pre-roll on a short max segment would fill segments with the silence before the onset.
        self.pre_roll_samples = min(settings.pre_roll_ms * SAMPLES_PER_MS,
                                    int(MAX_PRE_ROLL_FRACTION * self.max_segment_samples))
        self.min_cut_samples = int(MIN_CUT_FRACTION * self.max_segment_samples)
        self.cut_window_samples = round(min(cut_window_s, settings.max_segment_s) * SAMPLE_RATE)
        if classify_frame is None:
            self._classify = webrtc_frames_classifier(settings.aggressiveness)
        else:
            self._classify = lambda frames: [classify_frame(frame) for frame in frames]
        self._buffer = _SampleBuffer()
        self._frames_end = 0  # stream samples [0, _frames_end) have been classified
        self._voiced_run = 0  # consecutive voiced frames while no segment is open
        self._silent_run = 0  # consecutive unvoiced frames while a segment is open
        self._segment: _Segment | None = None
        self._next_segment_id = 0
        self._previous_end = 0  # end_sample of the last closed segment: the next one starts no earlier
        self._flushed = False
        self._overhang_until = 0  # after end_segment(): voiced frames up to here may be webrtcvad's overhang

    # ---- read-only views -------------------------------------------------------------------------

    @property
    def samples_received(self) -> int:
        return self._buffer.end

    @property
    def open_segment(self) -> OpenSegment | None:
        """The announced segment in progress, with its audio up to the last sample received."""
        segment = self._segment
        if segment is None or not segment.announced:
            return None
        audio = self._buffer.view(segment.start_sample, self._buffer.end)
        return OpenSegment(segment.segment_id, segment.start_sample, audio)

    @property
    def num_samples_retained(self) -> int:
        """Samples held in memory: bounded by pre-roll + start run in silence, by max_segment_s in speech."""
        return self._buffer.num_retained

    # ---- input -----------------------------------------------------------------------------------

    def feed(self, samples: np.ndarray) -> list[Event]:
        """Take the next samples ([n] float, 16 kHz mono, any n) and return the events they caused."""
        if self._flushed:
            raise RuntimeError("feed() after flush(): the stream has ended; start a new Segmenter")
        samples = as_float32_mono(samples)
        self._buffer.append(samples)
        events: list[Event] = []
        frame = self.frame_samples
        start = self._frames_end
        count = (self._buffer.end - start) // frame
        if count:
            frames = self._buffer.view(start, start + count * frame).reshape(count, frame)
            for i, voiced in enumerate(self._classify(frames)):
                self._on_frame(bool(voiced), start + (i + 1) * frame, events)
        self._forget_unneeded_audio()
        return events

    def end_segment(self) -> list[Event]:
        """Close the open segment now ("flush": push-to-talk released) and go on: the stream, its timeline and its
        segment ids continue. Only whole frames received so far count; the rest belongs to what follows."""
        if self._flushed:
            raise RuntimeError("end_segment() after flush(): the stream has ended")
        events: list[Event] = []
        segment = self._segment
        if segment is not None and segment.announced:
            events.append(self._close(self._speech_end(segment), "flush"))
        self._segment = None  # an unannounced candidate shorter than min_segment_ms is a blip
        self._voiced_run = self._silent_run = 0
        # webrtcvad keeps saying "speech" for up to _MAX_OVERHANG_MS after speech stops: those frames must not
        # open a segment of their own; speech that goes on past them does (its pre-roll reaches back)
        self._overhang_until = self._frames_end + _MAX_OVERHANG_MS * SAMPLES_PER_MS
        return events

    def flush(self) -> list[Event]:
        """End of stream: classify the partial trailing frame and close the open segment ("flush")."""
        if self._flushed:
            return []
        self._flushed = True
        events: list[Event] = []
        received = self._buffer.end
        if received > self._frames_end:  # a partial frame: zero-pad it for the classifier only
            padded = np.zeros(self.frame_samples, dtype=np.float32)
            padded[: received - self._frames_end] = self._buffer.view(self._frames_end, received)
            self._on_frame(bool(self._classify(padded[None])[0]), received, events)
        segment = self._segment
        if segment is not None and segment.announced:
            events.append(self._close(self._speech_end(segment), "flush"))
        self._segment = None  # an unannounced candidate shorter than min_segment_ms is a blip
        self._buffer.discard_before(received)
        return events

    # ---- the state machine, one frame at a time --------------------------------------------------

    def _on_frame(self, voiced: bool, frame_end: int, events: list[Event]) -> None:
        frame_start = self._frames_end
        self._frames_end = frame_end
        segment = self._segment
        if segment is None:
            if voiced and frame_end <= self._overhang_until:
                return  # the flushed segment's speech dying out (or going on): not an onset yet
            self._overhang_until = 0 if not voiced else self._overhang_until
            self._voiced_run = self._voiced_run + 1 if voiced else 0
            if self._voiced_run >= self.start_frames:
                first_voiced = frame_start - (self._voiced_run - 1) * self.frame_samples
                self._begin(first_voiced, frame_end, events)
            return
        if voiced:
            segment.last_voiced_end = frame_end
            segment.num_voiced_frames += 1
            self._silent_run = 0
        else:
            self._silent_run += 1
        self._announce_if_due(events)
        if self._silent_run >= self.end_frames:
            self._end_by_silence(events)
        elif frame_end + self.frame_samples - segment.start_sample > self.max_segment_samples:
            self._cut_at_quietest_point(events)

    def _begin(self, first_voiced: int, frame_end: int, events: list[Event]) -> None:
        start = max(first_voiced - self.pre_roll_samples, self._previous_end, 0)
        self._segment = _Segment(
            segment_id=self._next_segment_id,
            start_sample=start,
            last_voiced_end=frame_end,
            num_voiced_frames=self._voiced_run,
        )
        self._voiced_run = 0
        self._silent_run = 0
        self._announce_if_due(events)
        if frame_end + self.frame_samples - start > self.max_segment_samples:
            self._cut_at_quietest_point(events)

    def _announce_if_due(self, events: list[Event]) -> None:
        segment = self._segment
        if segment is not None and not segment.announced:
            if segment.num_voiced_frames >= self.min_segment_frames:
                self._announce(events)

    def _announce(self, events: list[Event]) -> None:
        segment = self._segment
        segment.announced = True
        self._next_segment_id = segment.segment_id + 1
        events.append(SpeechStarted(segment.segment_id, segment.start_sample))

    def _end_by_silence(self, events: list[Event]) -> None:
        segment = self._segment
        if segment.announced:
            events.append(self._close(self._speech_end(segment), "silence"))
        self._segment = None  # an unannounced candidate was a blip: no event, no segment id used

    def _cut_at_quietest_point(self, events: list[Event]) -> None:
        """The segment would outgrow max_segment_s: close it at the quietest point of its last cut_window_s (never
        in its first min_cut_samples); what follows that point continues as the next segment, nothing dropped.
        Where the speech has ended inside the window, that is the cut: the segment ends as if by silence (and says
        so), rather than leaving a sliver of webrtcvad's overhang to open the next one."""
        segment = self._segment
        if not segment.announced:  # long enough to be speech, whatever min_segment_ms says
            self._announce(events)
        speech_end = self._speech_end(segment)
        earliest = max(segment.start_sample + self.min_cut_samples, self._frames_end - self.cut_window_samples)
        cut = self._quietest_point(segment.start_sample, earliest, speech_end) if speech_end > earliest else None
        speech_ended = segment.last_voiced_end < self._frames_end  # unvoiced frames follow the last voiced one
        if speech_ended and (cut is None or cut >= speech_end - self.hangover_samples - self.frame_samples):
            events.append(self._close(speech_end, "silence"))  # nothing of it continues in a next segment
            self._segment = None
            return
        events.append(self._close(cut, "max_length"))
        self._segment = _Segment(
            segment_id=self._next_segment_id,
            start_sample=cut,
            last_voiced_end=segment.last_voiced_end,
            num_voiced_frames=segment.num_voiced_frames,
        )
        self._announce(events)

    def _speech_end(self, segment: _Segment) -> int:
        """Where the speech of a segment ends: its last voiced frame, less webrtcvad's own overhang,
        plus hangover_ms. webrtcvad keeps saying "speech" for up to ~150 ms after speech stops; the
        unvoiced frames that follow tell us the noise floor, so trailing frames no louder than
        _OVERHANG_FLOOR_RATIO x that floor are given back (at most _MAX_OVERHANG_MS of them)."""
        frame = self.frame_samples
        end = segment.last_voiced_end
        num_silent = (self._frames_end - end) // frame
        if num_silent >= _MIN_FLOOR_FRAMES:
            floor = float(np.median(self._frame_energies(end, num_silent)))
            max_trim = max(0, min(_MAX_OVERHANG_MS // self.frame_ms, (end - segment.start_sample) // frame - 1))
            trailing = self._frame_energies(end - max_trim * frame, max_trim)[::-1]  # last frame first
            loud = np.nonzero(trailing > _OVERHANG_FLOOR_RATIO * floor)[0]
            end -= (int(loud[0]) if len(loud) else max_trim) * frame
        return min(end + self.hangover_samples, self._frames_end)

    def _frame_energies(self, first: int, num_frames: int) -> np.ndarray:
        """Mean energy of num_frames frames from stream sample `first`: [num_frames] float64."""
        frame = self.frame_samples
        frames = self._buffer.view(first, first + num_frames * frame).reshape(num_frames, frame)
        return np.einsum("ij,ij->i", frames, frames, dtype=np.float64) / frame

    def _quietest_point(self, start: int, earliest: int, latest: int) -> int:
        """The quietest point (qasr.audio.quietest_point) in [earliest, latest] of the segment starting at `start`,
        reading only classified frames: the same however the audio was fed."""
        first = max(start, earliest - self.frame_samples // 2)
        audio = self._buffer.view(first, latest)
        return first + quietest_point(audio, earliest - first, latest - first, self.frame_samples)

    def _close(self, end: int, reason: CloseReason) -> SegmentClosed:
        segment = self._segment
        audio = self._buffer.view(segment.start_sample, end).copy()
        audio.flags.writeable = False
        self._previous_end = end
        self._segment = None
        return SegmentClosed(segment.segment_id, segment.start_sample, end, audio, reason)

    def _forget_unneeded_audio(self) -> None:
        """In silence keep only what a segment opening on the next frame could reach back to."""
        if self._segment is not None:
            self._buffer.discard_before(self._segment.start_sample)
            return
        reach = self.pre_roll_samples + self.start_frames * self.frame_samples
        self._buffer.discard_before(max(self._previous_end, self._frames_end - reach))
