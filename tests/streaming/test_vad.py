"""The VAD segmenter, fed like a socket would feed it: samples in, events out, no event loop.

Truth for speech-like audio is where the inserted speech is, measured by energy on the clean signal.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import wave
from dataclasses import asdict, dataclass

import numpy as np
import pytest
import soxr

from qasr.audio import SAMPLE_RATE
from qasr.streaming.settings import SettingsError, VadSettings
from qasr.streaming.vad import SegmentClosed, Segmenter, SpeechStarted, webrtc_frames_classifier

SR = SAMPLE_RATE
MS = SR // 1000  # samples per millisecond
TOLERANCE = 100 * MS  # boundaries within 100 ms of the truth
NOISE = 0.002  # white-noise RMS (~ -54 dBFS): a quiet room through a laptop microphone
ESPEAK_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech recognition needs a voice activity detector.",
    "Please call me back tomorrow morning.",
    "Seven hundred and twelve.",
]
GAPS_S = [1.0, 0.8, 1.5, 1.2, 0.9]  # silence before each utterance, and after the last


@dataclass(frozen=True)
class Options:
    """A segmenter's settings (what a client chooses) and tuning (keyword arguments), to build identical ones;
    derived sizes (frame_samples, pre_roll_samples, ...) are read from a segmenter built with them."""

    aggressiveness: int = 2
    end_silence_ms: int = 500
    pre_roll_ms: int = 300
    max_segment_s: float = 30.0
    frame_ms: int = 30
    start_ms: int = 150
    hangover_ms: int = 50
    cut_window_s: float = 3.0
    min_segment_ms: int = 0

    def make(self, classify_frame=None) -> Segmenter:
        fields = asdict(self)
        settings = VadSettings(**{name: fields.pop(name) for name in ("aggressiveness", "end_silence_ms",
                                                                      "pre_roll_ms", "max_segment_s")})
        return Segmenter(settings, classify_frame=classify_frame, **fields)

    def __getattr__(self, name):
        return getattr(self.make(), name)


# ---- audio ---------------------------------------------------------------------------------------


def harmonic_voice(duration_s: float, f0: float = 140.0, level: float = 0.3) -> np.ndarray:
    """A voiced, speech-like burst: a gliding f0 with 24 harmonics, syllable-rate amplitude, 10 ms ramps."""
    t = np.arange(round(duration_s * SR)) / SR
    phase = 2 * np.pi * np.cumsum(f0 * (1 + 0.05 * np.sin(2 * np.pi * 3 * t))) / SR
    voice = sum(np.sin(k * phase) / k for k in range(1, 25))
    envelope = (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t) ** 2) * np.minimum(1.0, np.minimum(t, t[-1] - t) / 0.01)
    return (level * voice / np.abs(voice).max() * envelope).astype(np.float32)


def espeak(text: str, tmp_path) -> np.ndarray:
    path = tmp_path / "utterance.wav"
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    with wave.open(str(path)) as wav:
        assert wav.getnchannels() == 1 and wav.getsampwidth() == 2
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype=np.int16)
        rate = wav.getframerate()
    return soxr.resample(pcm.astype(np.float32) / 32768, rate, SR).astype(np.float32)


def speech_bounds(clean: np.ndarray) -> tuple[int, int]:
    """First and last 10 ms frame within 40 dB of the loudest one: where the speech is."""
    frames = clean[: len(clean) // (10 * MS) * 10 * MS].reshape(-1, 10 * MS).astype(np.float64)
    energy_db = 10 * np.log10(np.mean(frames**2, axis=1) + 1e-20)
    loud = np.nonzero(energy_db > energy_db.max() - 40)[0]
    return int(loud[0]) * 10 * MS, (int(loud[-1]) + 1) * 10 * MS


def join_with_pauses(utterances, gaps_s, noise=NOISE, seed=0):
    """silence, utterance, silence, ... plus white noise -> (stream, [(speech_start, speech_end)])."""
    parts, truth, position = [], [], 0
    for utterance, gap_s in zip([None, *utterances], gaps_s):
        if utterance is not None:
            start, end = speech_bounds(utterance)
            truth.append((position + start, position + end))
            parts.append(utterance)
            position += len(utterance)
        parts.append(np.zeros(round(gap_s * SR), dtype=np.float32))
        position += len(parts[-1])
    stream = np.concatenate(parts)
    stream += (noise * np.random.default_rng(seed).standard_normal(len(stream))).astype(np.float32)
    return stream, truth


@pytest.fixture(scope="module")
def espeak_stream(tmp_path_factory):
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng); CI installs it")
    tmp_path = tmp_path_factory.mktemp("espeak")
    return join_with_pauses([espeak(text, tmp_path) for text in ESPEAK_TEXTS], GAPS_S)


@pytest.fixture(scope="module")
def synthetic_stream():
    bursts = [harmonic_voice(1.6, 120), harmonic_voice(0.7, 210), harmonic_voice(2.2, 160), harmonic_voice(0.5, 100)]
    return join_with_pauses(bursts, GAPS_S)


# ---- helpers -------------------------------------------------------------------------------------


def feed_in_pieces(segmenter: Segmenter, stream: np.ndarray, piece: int) -> list:
    events = []
    for start in range(0, len(stream), piece):
        events += segmenter.feed(stream[start : start + piece])
    return events + segmenter.flush()


def closed(events) -> list[SegmentClosed]:
    return [event for event in events if isinstance(event, SegmentClosed)]


def assert_well_formed(events, stream):
    """Every SpeechStarted gets exactly one SegmentClosed; ids count from 0; segments are in order,
    never overlap, and hold exactly stream[start:end]."""
    started = [event for event in events if isinstance(event, SpeechStarted)]
    segments = closed(events)
    assert [event.segment_id for event in started] == list(range(len(started)))
    assert [(s.segment_id, s.start_sample) for s in segments] == [(e.segment_id, e.start_sample) for e in started]
    for segment in segments:
        assert 0 <= segment.start_sample < segment.end_sample <= len(stream)
        assert segment.audio.dtype == np.float32
        np.testing.assert_array_equal(segment.audio, stream[segment.start_sample : segment.end_sample])
    for before, after in zip(segments, segments[1:]):
        assert before.end_sample <= after.start_sample


def assert_matches_truth(segments, truth, options: Options):
    assert len(segments) == len(truth), [(s.start_sample / SR, s.end_sample / SR) for s in segments]
    previous_end = 0
    for segment, (speech_start, speech_end) in zip(segments, truth):
        expected_start = max(speech_start - options.pre_roll_samples, previous_end)
        assert abs(segment.start_sample - expected_start) <= TOLERANCE, (segment, speech_start)
        assert abs(segment.end_sample - speech_end) <= TOLERANCE, (segment, speech_end)
        assert segment.reason == "silence"
        previous_end = segment.end_sample


# ---- segmentation of speech with known pauses ----------------------------------------------------


@pytest.mark.parametrize("frame_ms", [10, 20, 30])
@pytest.mark.parametrize("pre_roll_ms", [0, 300])
def test_espeak_utterances_are_cut_at_their_pauses(espeak_stream, frame_ms, pre_roll_ms):
    stream, truth = espeak_stream
    options = Options(frame_ms=frame_ms, pre_roll_ms=pre_roll_ms)
    events = feed_in_pieces(options.make(), stream, 4000)
    assert_well_formed(events, stream)
    assert_matches_truth(closed(events), truth, options)


@pytest.mark.parametrize("aggressiveness", [0, 1, 2, 3])
def test_synthetic_voice_is_cut_at_its_pauses(synthetic_stream, aggressiveness):
    stream, truth = synthetic_stream
    options = Options(aggressiveness=aggressiveness)
    events = feed_in_pieces(options.make(), stream, 4000)
    assert_well_formed(events, stream)
    assert_matches_truth(closed(events), truth, options)


def energy_classifier(threshold: float = 0.01):
    """A deterministic stand-in for webrtcvad: a frame is speech when its RMS exceeds the threshold."""
    return lambda frame: float(np.sqrt(np.mean(frame.astype(np.float64) ** 2))) > threshold


def test_timestamps_are_sample_exact_with_pre_roll_and_hangover():
    """With a classifier that has no overhang of its own, the arithmetic is exact: start = first voiced
    frame - pre-roll (clamped at 0 and at the previous end), end = last voiced frame + hangover."""
    options = Options(start_ms=90, end_silence_ms=300, hangover_ms=50, pre_roll_ms=300)
    frame = options.frame_samples
    stream = np.zeros(200 * frame, dtype=np.float32)
    bursts = [(5 * frame, 20 * frame), (35 * frame, 50 * frame), (100 * frame, 130 * frame)]
    for start, end in bursts:
        stream[start:end] = 0.5
    events = feed_in_pieces(options.make(classify_frame=energy_classifier()), stream, 1000)
    assert_well_formed(events, stream)
    spans = [(s.start_sample, s.end_sample, s.reason) for s in closed(events)]
    hangover = options.hangover_samples
    first_end = 20 * frame + hangover
    assert spans == [
        (0, first_end, "silence"),  # clamped at the stream start
        (max(35 * frame - options.pre_roll_samples, first_end), 50 * frame + hangover, "silence"),  # at prev end
        (100 * frame - options.pre_roll_samples, 130 * frame + hangover, "silence"),
    ]
    started = [e for e in events if isinstance(e, SpeechStarted)]
    assert [e.start_sample for e in started] == [s[0] for s in spans]


# ---- chunking, flush, coverage -------------------------------------------------------------------


def event_signature(events):
    return [
        (type(e).__name__, e.segment_id, e.start_sample, getattr(e, "end_sample", None), getattr(e, "reason", None))
        for e in events
    ]


@pytest.mark.parametrize(
    "options",
    [Options(), Options(frame_ms=10, max_segment_s=1.5, cut_window_s=1.0, min_segment_ms=300)],
    ids=["defaults", "short-max-and-min"],
)
def test_piece_size_does_not_change_the_events(synthetic_stream, options):
    stream, _ = synthetic_stream
    stream = stream[: 7 * SR + 123]  # ends inside the third burst, on a partial frame
    reference = feed_in_pieces(options.make(), stream, len(stream))
    reasons = [segment.reason for segment in closed(reference)]
    assert reasons[-1] == "flush" and len(reasons) >= 3
    assert ("max_length" in reasons) == (options.max_segment_s < 2)
    for piece in (1, 37, 160, 480, 4000):
        events = feed_in_pieces(options.make(), stream, piece)
        assert event_signature(events) == event_signature(reference), piece
        for mine, theirs in zip(closed(events), closed(reference)):
            np.testing.assert_array_equal(mine.audio, theirs.audio)


def test_flush_closes_the_open_segment_including_a_partial_frame():
    options = Options()
    # still speaking when the stream ends, on a partial frame
    stream = np.concatenate([np.zeros(SR // 2, np.float32), harmonic_voice(1.5)[: SR + 200]])
    segmenter = options.make()
    events = segmenter.feed(stream)
    assert [type(e) for e in events] == [SpeechStarted]
    assert segmenter.open_segment is not None
    events += segmenter.flush()
    assert_well_formed(events, stream)
    (segment,) = closed(events)
    assert segment.reason == "flush"
    assert len(stream) % options.frame_samples != 0
    assert segment.end_sample == len(stream)  # the partial trailing frame is inside the segment
    assert segmenter.open_segment is None
    assert segmenter.flush() == []
    with pytest.raises(RuntimeError, match="flush"):
        segmenter.feed(np.zeros(10, np.float32))


def test_flush_of_a_silent_stream_yields_nothing():
    segmenter = Segmenter()
    assert segmenter.feed(np.zeros(SR, np.float32)) == []
    assert segmenter.flush() == []


def recording_classifier(aggressiveness: int, decisions: list):
    classify = webrtc_frames_classifier(aggressiveness)

    def record(frame):
        decisions.append(classify(frame[None])[0])
        return decisions[-1]

    return record


@pytest.mark.parametrize("stream_name", ["synthetic_stream", "espeak_stream"])
def test_no_voiced_audio_is_lost(request, stream_name):
    """Every voiced frame of a run long enough to open a segment lies inside a closed segment, except
    webrtcvad's overhang after a segment's speech, which must be as quiet as the background noise."""
    stream, _ = request.getfixturevalue(stream_name)
    options = Options(frame_ms=20, max_segment_s=2.5, cut_window_s=1.0)  # cuts happen too
    decisions: list[bool] = []
    segmenter = options.make(classify_frame=recording_classifier(options.aggressiveness, decisions))
    events = feed_in_pieces(segmenter, stream, 333)
    assert_well_formed(events, stream)
    segments = closed(events)
    assert any(s.reason == "max_length" for s in segments)

    frame = options.frame_samples
    voiced = np.array(decisions[: len(stream) // frame])
    covered = np.zeros(len(stream), dtype=bool)
    for segment in segments:
        covered[segment.start_sample : segment.end_sample] = True
    run_length = np.zeros(len(voiced), dtype=int)  # length of the voiced run each frame belongs to
    start = 0
    for index in range(1, len(voiced) + 1):
        if index == len(voiced) or voiced[index] != voiced[start]:
            run_length[start:index] = index - start if voiced[start] else 0
            start = index
    for index in np.nonzero(run_length >= options.start_frames)[0]:
        span = slice(index * frame, (index + 1) * frame)
        if covered[span].all():
            continue
        assert float(np.sqrt(np.mean(stream[span].astype(np.float64) ** 2))) < 2 * NOISE, index * frame / SR
        ends = [s.end_sample for s in segments if s.end_sample < (index + 1) * frame]
        assert ends and (index + 1) * frame - ends[-1] <= 150 * MS, index * frame / SR


# ---- long utterances -----------------------------------------------------------------------------


def test_max_segment_cuts_a_long_utterance_at_quiet_points():
    """10 s of voice with 100 ms dips every 0.8 s (too short to end a segment): cut into segments of at most
    max_segment_s, each cut inside a dip, contiguous, nothing lost."""
    dip, period = 100 * MS, 800 * MS
    voice = harmonic_voice(10.0)
    dips = [(start, start + dip) for start in range(period - dip, len(voice) - period, period)]
    for start, end in dips:
        voice[start:end] = 0.0
    stream, _ = join_with_pauses([voice], [1.0, 1.0])
    offset = SR  # the voice starts after 1 s of noise
    options = Options(max_segment_s=3.0, cut_window_s=1.5)
    events = feed_in_pieces(options.make(), stream, 480)
    assert_well_formed(events, stream)
    segments = closed(events)
    assert len(segments) >= 4
    assert [s.reason for s in segments] == ["max_length"] * (len(segments) - 1) + ["silence"]
    assert all(s.num_samples <= options.max_segment_samples for s in segments)
    for before, after in zip(segments, segments[1:]):
        assert after.start_sample == before.end_sample  # contiguous: no audio dropped at a cut
        cut = before.end_sample - offset
        assert any(start <= cut < end for start, end in dips), cut / SR
    assert segments[0].start_sample <= offset and segments[-1].end_sample >= offset + len(voice) - TOLERANCE


def test_min_segment_ignores_blips_but_keeps_real_speech():
    options = Options(min_segment_ms=400)
    blip = harmonic_voice(0.25)
    word = harmonic_voice(0.9)
    stream, truth = join_with_pauses([blip, word], [1.0, 1.0, 1.0])
    segmenter = options.make()
    events, announced_at = [], None
    for start in range(0, len(stream), 480):
        events += segmenter.feed(stream[start : start + 480])
        if events and announced_at is None:
            announced_at = segmenter.samples_received
    assert truth[1][0] + 400 * MS <= announced_at <= truth[1][0] + 400 * MS + TOLERANCE  # min_segment_ms voiced
    events += segmenter.flush()
    assert_well_formed(events, stream)
    (segment,) = closed(events)
    assert segment.segment_id == 0  # the blip never took an id
    assert abs(segment.start_sample - (truth[1][0] - options.pre_roll_samples)) <= TOLERANCE  # back-dated
    assert abs(segment.end_sample - truth[1][1]) <= TOLERANCE


# ---- views, memory, options ----------------------------------------------------------------------


def test_open_segment_is_a_read_only_view_of_the_audio_so_far():
    stream, _ = join_with_pauses([harmonic_voice(2.0)], [1.0, 1.0])
    segmenter = Segmenter()
    assert segmenter.feed(stream[: SR // 2]) == [] and segmenter.open_segment is None
    events = segmenter.feed(stream[SR // 2 : 2 * SR + 77])
    (started,) = events
    view = segmenter.open_segment
    assert (view.segment_id, view.start_sample) == (started.segment_id, started.start_sample)
    assert segmenter.samples_received == 2 * SR + 77
    np.testing.assert_array_equal(view.audio, stream[view.start_sample : 2 * SR + 77])
    with pytest.raises(ValueError):
        view.audio[0] = 1.0


@pytest.mark.parametrize("noise", [0.0, NOISE])
def test_silence_keeps_memory_bounded_and_yields_nothing(noise):
    options = Options()
    segmenter = options.make()
    rng = np.random.default_rng(1)
    reach = options.pre_roll_samples + options.start_frames * options.frame_samples
    for _ in range(60 * 25):  # 60 s in 40 ms pieces
        assert segmenter.feed((noise * rng.standard_normal(640)).astype(np.float32)) == []
        assert segmenter.num_samples_retained <= 2 * reach + 2 * 640
    assert segmenter.samples_received == 60 * SR
    assert segmenter.flush() == []


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"aggressiveness": 4}, "vad.aggressiveness"),
        ({"aggressiveness": -1}, "vad.aggressiveness"),
        ({"aggressiveness": True}, "vad.aggressiveness"),
        ({"end_silence_ms": 0}, "vad.end_silence_ms"),
        ({"end_silence_ms": 5001}, "vad.end_silence_ms"),
        ({"pre_roll_ms": -10}, "vad.pre_roll_ms"),
        ({"pre_roll_ms": 2001}, "vad.pre_roll_ms"),
        ({"max_segment_s": 0.5}, "vad.max_segment_s"),
        ({"max_segment_s": math.nan}, "vad.max_segment_s"),
    ],
)
def test_settings_are_validated_in_wire_terms(kwargs, field):
    with pytest.raises(SettingsError, match=field.replace(".", r"\.")) as caught:
        VadSettings(**kwargs)
    assert caught.value.field == field


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"frame_ms": 25}, "frame_ms"),
        ({"start_ms": 0}, "start_ms"),
        ({"hangover_ms": 600}, "hangover_ms"),
        ({"hangover_ms": -1}, "hangover_ms"),
        ({"min_segment_ms": -1}, "min_segment_ms"),
        ({"cut_window_s": 0}, "cut_window_s"),
        ({"max_segment_s": 1.0, "start_ms": 600}, "half of max_segment_s"),
    ],
)
def test_tuning_is_validated(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Options(**kwargs).make()


def test_a_pre_roll_longer_than_a_quarter_of_max_segment_is_clamped():
    """A 2 s pre-roll with 2 s segments (each within its documented range) is taken, as 500 ms of pre-roll."""
    options = Options(pre_roll_ms=2000, max_segment_s=2.0)
    assert options.pre_roll_samples == 500 * MS
    assert Options(pre_roll_ms=300, max_segment_s=2.0).pre_roll_samples == 300 * MS
    stream, truth = join_with_pauses([harmonic_voice(1.0)], [2.5, 1.0])
    (segment,) = closed(feed_in_pieces(options.make(), stream, 480))
    assert abs(segment.start_sample - (truth[0][0] - 500 * MS)) <= TOLERANCE


def continuous_speech(seconds: float, seed: int = 0) -> np.ndarray:
    """Voice without pauses long enough to end a segment: 40-120 ms dips between 'words' of 0.2-0.6 s."""
    rng = np.random.default_rng(seed)
    words, total = [], 0.0
    while total < seconds:
        word = harmonic_voice(min(rng.uniform(0.2, 0.6), seconds - total + 0.01), rng.uniform(100, 200))
        gap = np.zeros(round(rng.uniform(0.04, 0.12) * SR), np.float32)
        words += [word, gap]
        total += (len(word) + len(gap)) / SR
    return np.concatenate(words)[: round(seconds * SR)]


@pytest.mark.parametrize("seed", range(4))
def test_a_small_max_segment_on_continuous_speech_gives_segments_near_it(seed):
    """7.4 s of speech with max_segment_s 2: no slivers in the pre-roll or at word gaps, at most ceil(7.4 / 2) + 1
    segments, each but the last at least 3/4 of max_segment_s."""
    speech = continuous_speech(7.4, seed)
    stream, _ = join_with_pauses([speech], [1.0, 1.0], seed=seed)
    options = Options(max_segment_s=2.0)
    events = feed_in_pieces(options.make(), stream, 320)
    assert_well_formed(events, stream)
    segments = closed(events)
    assert 4 <= len(segments) <= math.ceil(7.4 / 2) + 1, [(s.start_sample / SR, s.end_sample / SR) for s in segments]
    assert all(s.num_samples >= 1.5 * SR for s in segments[:-1])
    assert all(s.num_samples <= options.max_segment_samples for s in segments)
    for before, after in zip(segments, segments[1:]):
        assert after.start_sample == before.end_sample and before.reason == "max_length"


def test_end_segment_closes_the_open_segment_and_the_stream_goes_on():
    first, _ = join_with_pauses([harmonic_voice(1.0)], [0.5, 0.0])
    second, _ = join_with_pauses([harmonic_voice(0.8, 200)], [0.6, 1.0], seed=1)
    stream = np.concatenate([first, second])
    segmenter = Segmenter(VadSettings(pre_roll_ms=0))
    events = segmenter.feed(first)
    events += segmenter.end_segment()
    assert [type(event) for event in events] == [SpeechStarted, SegmentClosed] and events[1].reason == "flush"
    assert segmenter.open_segment is None and segmenter.end_segment() == []
    events += segmenter.feed(second) + segmenter.flush()
    assert_well_formed(events, stream)
    flushed, after = closed(events)
    assert abs(flushed.end_sample - len(first)) <= TOLERANCE
    assert after.segment_id == 1 and after.reason == "silence"
    assert abs(after.start_sample - (len(first) + 0.6 * SR)) <= TOLERANCE  # the timeline goes on: absolute times
    with pytest.raises(RuntimeError, match="ended"):
        segmenter.end_segment()


@pytest.mark.parametrize(
    "samples, message",
    [
        (np.zeros((10, 2), np.float32), "shape"),
        (np.zeros(10, np.int16), "int16"),
    ],
)
def test_feed_rejects_what_it_cannot_take(samples, message):
    with pytest.raises(ValueError, match=message):
        Segmenter().feed(samples)


def random_stream_and_options(seed: int):
    """Voice bursts of random length, pitch and dips between random pauses, under random options."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(rng.integers(1, 6)):
        parts.append(np.zeros(round(rng.uniform(0, 1.5) * SR), np.float32))
        voice = harmonic_voice(rng.uniform(0.05, 6.0), rng.uniform(90, 250))
        for _ in range(rng.integers(0, 5)):
            start = rng.integers(0, len(voice))
            voice[start : start + round(rng.uniform(0.01, 0.7) * SR)] = 0.0
        parts.append(voice)
    stream = np.concatenate(parts)
    stream += (rng.uniform(0, 0.004) * rng.standard_normal(len(stream))).astype(np.float32)
    end_silence_ms = int(rng.choice([100, 300, 500, 1000]))
    options = Options(
        aggressiveness=int(rng.integers(0, 4)),
        frame_ms=int(rng.choice([10, 20, 30])),
        start_ms=int(rng.choice([30, 90, 150, 300])),
        end_silence_ms=end_silence_ms,
        hangover_ms=min(end_silence_ms, int(rng.choice([0, 50, 200]))),
        pre_roll_ms=int(rng.choice([0, 100, 300, 500])),
        max_segment_s=float(rng.choice([1.0, 1.7, 3.0, 30.0])),
        cut_window_s=float(rng.choice([0.1, 0.5, 3.0])),
        min_segment_ms=int(rng.choice([0, 0, 200, 800])),
    )
    return stream, options, int(rng.integers(1, 3000))


@pytest.mark.parametrize("seed", range(12))
def test_random_streams_keep_the_invariants(seed):
    stream, options, piece = random_stream_and_options(seed)
    reference = feed_in_pieces(options.make(), stream, len(stream))
    assert_well_formed(reference, stream)
    assert all(segment.num_samples <= options.max_segment_samples for segment in closed(reference))
    assert event_signature(feed_in_pieces(options.make(), stream, piece)) == event_signature(reference)
