"""Sans-I/O voice-activity segmenter: 16 kHz float32 PCM in, speech-segment events out.

`Segmenter.feed(samples)` accepts pieces of any length and returns the events they caused;
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
- A segment never grows past `max_segment_s`: it is cut at the quietest frame of its last
  `cut_window_s` and the rest continues at once as the next segment (next start == previous end).
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

from .resample import as_float32_mono

SAMPLE_RATE = 16_000  # Hz; the segmenter's only input rate (resample first: streaming/resample.py)
SAMPLES_PER_MS = SAMPLE_RATE // 1000  # 16

# frame: [frame_samples] float32 in [-1, 1] -> is it speech? Stateful; one instance per stream.
FrameClassifier = Callable[[np.ndarray], bool]
# the same for consecutive frames at once: [n, frame_samples] -> n decisions (what the segmenter calls)
FramesClassifier = Callable[[np.ndarray], list[bool]]

CloseReason = Literal["silence", "max_length", "flush"]

# webrtcvad's internal overhang lasts at most 14 x 10 ms, 7 x 20 ms or 5 x 30 ms frames (vad_core.c).
_MAX_OVERHANG_MS = 150
_OVERHANG_FLOOR_RATIO = 3.0  # a trailing frame this close to the noise floor (~5 dB) is not speech
_MIN_FLOOR_FRAMES = 3  # unvoiced frames needed to trust a noise-floor estimate


@dataclass(frozen=True)
class VadOptions:
    """How a stream is cut into segments. Validated once, here; the defaults suit conversational speech."""

    aggressiveness: int = 2  # webrtcvad mode 0 (keeps most audio) .. 3 (drops most non-speech)
    frame_ms: int = 30  # webrtcvad frame: 10, 20 or 30 ms
    start_ms: int = 150  # consecutive voiced audio that opens a segment (> webrtcvad's ~100 ms start-up blip)
    end_silence_ms: int = 500  # unvoiced audio that closes a segment
    hangover_ms: int = 50  # audio kept after the speech ends (soft word endings); <= end_silence_ms
    pre_roll_ms: int = 300  # audio kept before the first voiced frame (soft onsets, VAD latency)
    max_segment_s: float = 30.0  # a longer segment is cut at its quietest point; the rest continues
    cut_window_s: float = 3.0  # the quietest point is searched in this last stretch (capped at max_segment_s)
    min_segment_ms: int = 0  # voiced audio a segment needs before it is announced; 0 = no minimum

    def __post_init__(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"VadOptions: {message}")

        require(
            isinstance(self.aggressiveness, int) and 0 <= self.aggressiveness <= 3,
            f"aggressiveness must be an int 0..3, got {self.aggressiveness!r}",
        )
        require(self.frame_ms in (10, 20, 30), f"frame_ms must be 10, 20 or 30 (webrtcvad), got {self.frame_ms!r}")
        require(self.start_ms > 0, f"start_ms must be > 0, got {self.start_ms!r}")
        require(self.end_silence_ms > 0, f"end_silence_ms must be > 0, got {self.end_silence_ms!r}")
        require(
            0 <= self.hangover_ms <= self.end_silence_ms,
            f"hangover_ms must be in 0..end_silence_ms ({self.end_silence_ms}), got {self.hangover_ms!r}",
        )
        require(self.pre_roll_ms >= 0, f"pre_roll_ms must be >= 0, got {self.pre_roll_ms!r}")
        require(self.min_segment_ms >= 0, f"min_segment_ms must be >= 0, got {self.min_segment_ms!r}")
        require(self.max_segment_s >= 1.0, f"max_segment_s must be >= 1 s, got {self.max_segment_s!r}")
        require(self.cut_window_s >= 0.1, f"cut_window_s must be >= 0.1 s, got {self.cut_window_s!r}")
        # A segment opens already holding pre-roll + the start run; it must fit, with a frame to spare.
        opening_ms = self.pre_roll_ms + self.start_frames * self.frame_ms + self.frame_ms
        require(
            opening_ms <= self.max_segment_s * 1000,
            f"pre_roll_ms + start_ms + frame_ms ({opening_ms} ms) must fit in max_segment_s ({self.max_segment_s} s)",
        )

    # Derived sizes, in frames or samples (time options round up to whole frames where frames count).
    @property
    def frame_samples(self) -> int:
        return int(self.frame_ms) * SAMPLES_PER_MS

    @property
    def start_frames(self) -> int:
        return math.ceil(self.start_ms / self.frame_ms)

    @property
    def end_frames(self) -> int:
        return math.ceil(self.end_silence_ms / self.frame_ms)

    @property
    def min_segment_frames(self) -> int:
        return math.ceil(self.min_segment_ms / self.frame_ms)

    @property
    def hangover_samples(self) -> int:
        return round(self.hangover_ms * SAMPLES_PER_MS)

    @property
    def pre_roll_samples(self) -> int:
        return round(self.pre_roll_ms * SAMPLES_PER_MS)

    @property
    def max_segment_samples(self) -> int:
        return round(self.max_segment_s * SAMPLE_RATE)

    @property
    def cut_window_samples(self) -> int:
        return round(min(self.cut_window_s, self.max_segment_s) * SAMPLE_RATE)


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

    def __init__(self, options: VadOptions = VadOptions(), *, classify_frame: FrameClassifier | None = None) -> None:
        self.options = options
        if classify_frame is None:
            self._classify = webrtc_frames_classifier(options.aggressiveness)
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
        frame = self.options.frame_samples
        start = self._frames_end
        count = (self._buffer.end - start) // frame
        if count:
            frames = self._buffer.view(start, start + count * frame).reshape(count, frame)
            for i, voiced in enumerate(self._classify(frames)):
                self._on_frame(bool(voiced), start + (i + 1) * frame, events)
        self._forget_unneeded_audio()
        return events

    def flush(self) -> list[Event]:
        """End of stream: classify the partial trailing frame and close the open segment ("flush")."""
        if self._flushed:
            return []
        self._flushed = True
        events: list[Event] = []
        received = self._buffer.end
        if received > self._frames_end:  # a partial frame: zero-pad it for the classifier only
            padded = np.zeros(self.options.frame_samples, dtype=np.float32)
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
        options = self.options
        frame_start = self._frames_end
        self._frames_end = frame_end
        segment = self._segment
        if segment is None:
            self._voiced_run = self._voiced_run + 1 if voiced else 0
            if self._voiced_run >= options.start_frames:
                first_voiced = frame_start - (self._voiced_run - 1) * options.frame_samples
                self._begin(first_voiced, frame_end, events)
            return
        if voiced:
            segment.last_voiced_end = frame_end
            segment.num_voiced_frames += 1
            self._silent_run = 0
        else:
            self._silent_run += 1
        self._announce_if_due(events)
        if self._silent_run >= options.end_frames:
            self._end_by_silence(events)
        elif frame_end + options.frame_samples - segment.start_sample > options.max_segment_samples:
            self._cut_at_quietest_point(events)

    def _begin(self, first_voiced: int, frame_end: int, events: list[Event]) -> None:
        start = max(first_voiced - self.options.pre_roll_samples, self._previous_end, 0)
        self._segment = _Segment(
            segment_id=self._next_segment_id,
            start_sample=start,
            last_voiced_end=frame_end,
            num_voiced_frames=self._voiced_run,
        )
        self._voiced_run = 0
        self._silent_run = 0
        self._announce_if_due(events)
        if frame_end + self.options.frame_samples - start > self.options.max_segment_samples:
            self._cut_at_quietest_point(events)

    def _announce_if_due(self, events: list[Event]) -> None:
        segment = self._segment
        if segment is not None and not segment.announced:
            if segment.num_voiced_frames >= self.options.min_segment_frames:
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
        """The segment would outgrow max_segment_s: close it at the quietest frame of its last
        cut_window_s; what follows that point continues as the next segment, nothing dropped."""
        segment = self._segment
        if not segment.announced:  # long enough to be speech, whatever min_segment_ms says
            self._announce(events)
        cut = self._quietest_point(segment.start_sample, self._frames_end)
        if segment.last_voiced_end <= cut:  # only silence after the cut: end as if by silence
            events.append(self._close(self._speech_end(segment), "max_length"))
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
        frame = self.options.frame_samples
        end = segment.last_voiced_end
        num_silent = (self._frames_end - end) // frame
        if num_silent >= _MIN_FLOOR_FRAMES:
            floor = float(np.median(self._frame_energies(end, num_silent)))
            max_trim = max(0, min(_MAX_OVERHANG_MS // self.options.frame_ms, (end - segment.start_sample) // frame - 1))
            trailing = self._frame_energies(end - max_trim * frame, max_trim)[::-1]  # last frame first
            loud = np.nonzero(trailing > _OVERHANG_FLOOR_RATIO * floor)[0]
            end -= (int(loud[0]) if len(loud) else max_trim) * frame
        return min(end + self.options.hangover_samples, self._frames_end)

    def _frame_energies(self, first: int, num_frames: int) -> np.ndarray:
        """Mean energy of num_frames frames from stream sample `first`: [num_frames] float64."""
        frame = self.options.frame_samples
        frames = self._buffer.view(first, first + num_frames * frame).reshape(num_frames, frame)
        return np.einsum("ij,ij->i", frames, frames, dtype=np.float64) / frame

    def _quietest_point(self, start: int, stop: int) -> int:
        """Middle of the lowest-energy whole frame (on the stream's frame grid) in the window
        [max(start, stop - cut_window), stop). The segment is longer than a second, so frames exist."""
        frame = self.options.frame_samples
        first = max(start, stop - self.options.cut_window_samples)
        first = -(-first // frame) * frame  # round up onto the frame grid
        energy = self._frame_energies(first, (stop - first) // frame)
        return first + int(np.argmin(energy)) * frame + frame // 2

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
        reach = self.options.pre_roll_samples + self.options.start_frames * self.options.frame_samples
        self._buffer.discard_before(max(self._previous_end, self._frames_end - reach))
