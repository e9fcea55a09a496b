"""qasr.model.audio: mel parity with the official extractor, token arithmetic, loading, PCM decoding, splitting."""

import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from qasr.model import audio
from qasr.model.audio import AudioError

from fakes import speech_clip

SR = audio.SAMPLE_RATE


# ---------------------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def official_extractor():
    transformers = pytest.importorskip("transformers")
    # as Qwen3-ASR's processor configures it
    return transformers.WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400,
                                                padding_value=0.0, dither=0.0)


def official_features(extractor, clip: np.ndarray) -> np.ndarray:
    out = extractor(clip, sampling_rate=SR, padding=True, truncation=False, return_tensors="np")
    return out["input_features"][0]  # [128, F]


@pytest.mark.parametrize("seconds", [0.3, 1.0, 2.37, 8.0, 10.9, 40.0])
def test_log_mel_matches_official_extractor(official_extractor, seconds):
    clip = speech_clip(seconds, seed=int(seconds * 100))
    expected = official_features(official_extractor, clip)
    ours = audio.log_mel(clip)
    assert ours.dtype == torch.float32
    assert ours.shape == (audio.N_MELS, audio.num_frames(len(clip))) == expected.shape
    np.testing.assert_allclose(ours.numpy(), expected, rtol=0, atol=1e-4)


def test_log_mel_clamps_to_eight_below_the_clip_maximum():
    clip = speech_clip(3.0)
    clip[: SR // 2] = 0  # digital silence: far below the clamp
    features = audio.log_mel(clip)
    floor = (features.max() - audio.LOG_MEL_DYNAMIC_RANGE / 4.0).item()  # clamp after the (x + 4) / 4 scaling
    assert features.min().item() == pytest.approx(floor, abs=1e-5)
    assert (features[:, :40] == features.min()).all()


def test_log_mel_batch_rows_equal_each_clip_alone():
    rng = np.random.default_rng(1)
    lengths = [SR * 3 + 77, 161, 0, 4000, SR, 120, 201, int(SR * 8.5)]
    clips = [torch.from_numpy(speech_clip(n / SR, seed=i)) * float(rng.uniform(0.1, 3)) for i, n in enumerate(lengths)]
    features, num_frames = audio.log_mel_batch(clips)
    expected_frames = [n // audio.HOP_LENGTH for n in lengths]
    assert num_frames.tolist() == expected_frames
    assert features.shape == (len(clips), audio.N_MELS, max(expected_frames))
    for row, clip, frames in zip(features, clips, expected_frames):
        alone = audio.log_mel(clip)
        assert alone.shape == (audio.N_MELS, frames)
        torch.testing.assert_close(row[:, :frames], alone, rtol=0, atol=1e-6)
        assert (row[:, frames:] == 0).all()


def test_log_mel_batch_does_not_depend_on_batch_mates(official_extractor):
    # the official extractor pads a batch with zeros before the clamp; we must not
    short, long = speech_clip(1.37, seed=3), speech_clip(6.0, seed=4) * 4
    features, num_frames = audio.log_mel_batch([short, long])
    torch.testing.assert_close(features[0, :, : num_frames[0]], torch.from_numpy(official_features(official_extractor, short)),
                               rtol=0, atol=1e-4)


def test_silence_and_tiny_clips_give_finite_features():
    silence = audio.log_mel(np.zeros(SR, dtype=np.float32))
    assert silence.shape == (audio.N_MELS, 100)
    assert torch.isfinite(silence).all()
    assert torch.allclose(silence, torch.full_like(silence, (-10.0 + 4.0) / 4.0))  # log10(1e-10), scaled

    one_frame = audio.log_mel(torch.randn(170))  # shorter than the reflect padding: torch.stft itself refuses this
    assert one_frame.shape == (audio.N_MELS, 1) and torch.isfinite(one_frame).all()
    assert audio.log_mel(torch.randn(159)).shape == (audio.N_MELS, 0)
    features, num_frames = audio.log_mel_batch([])
    assert features.shape == (0, audio.N_MELS, 0) and num_frames.shape == (0,)


def test_log_mel_accepts_any_float_input_and_rejects_the_rest():
    clip = speech_clip(0.5)
    reference = audio.log_mel(clip)
    torch.testing.assert_close(audio.log_mel(clip.astype(np.float64)), reference)
    half = audio.log_mel(torch.from_numpy(clip).to(torch.bfloat16))
    assert half.dtype == torch.float32 and half.shape == reference.shape
    with pytest.raises(ValueError, match="1-D"):
        audio.log_mel(np.zeros((2, SR), dtype=np.float32))
    with pytest.raises(ValueError, match="decode_pcm"):
        audio.log_mel(np.zeros(SR, dtype=np.int16))


def load_official_processing_module():
    """The official processing module, loaded from its file so qwen_asr's package imports (librosa, ...) are skipped."""
    spec = importlib.util.find_spec("qwen_asr")
    if spec is None:
        pytest.skip("qwen-asr is not installed")
    path = Path(spec.submodule_search_locations[0]) / "core" / "transformers_backend" / "processing_qwen3_asr.py"
    module_spec = importlib.util.spec_from_file_location("_official_processing_qwen3_asr", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_num_audio_tokens_matches_official_formula():
    official = load_official_processing_module()._get_feat_extract_output_lengths
    frames = np.arange(0, 3001)
    expected = official(frames)
    assert [audio.num_audio_tokens(int(f)) for f in frames] == expected.tolist()
    torch.testing.assert_close(audio.num_audio_tokens(torch.from_numpy(frames)), torch.from_numpy(expected))
    assert audio.num_audio_tokens(0) == 0 and audio.num_audio_tokens(1) == 1


def test_constants_agree_with_each_other():
    assert audio.FRAMES_PER_SECOND == 100 and audio.CHUNK_FRAMES == 100
    assert audio.TOKENS_PER_CHUNK == 13 and audio.WINDOW_FRAMES == 800 and audio.WINDOW_TOKENS == 104
    assert audio.num_audio_tokens(audio.WINDOW_FRAMES) == audio.WINDOW_TOKENS
    assert audio.num_frames(audio.CHUNK_SAMPLES) == audio.CHUNK_FRAMES
    assert audio.num_frames(audio.WINDOW_SAMPLES) == audio.WINDOW_FRAMES
    assert audio.num_frames(torch.tensor([0, 159, 160, 16000])).tolist() == [0, 0, 1, 100]
    with pytest.raises(ValueError):
        audio.num_frames(-1)


# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------


def sine(freq: float, seconds: float, sample_rate: int, amplitude: float = 0.5) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * freq * np.arange(int(seconds * sample_rate)) / sample_rate)).astype(np.float32)


def dominant_frequency(signal: np.ndarray, sample_rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(signal * np.hanning(len(signal))))
    return float(np.fft.rfftfreq(len(signal), 1 / sample_rate)[np.argmax(spectrum)])


@pytest.mark.parametrize("sample_rate, fmt, subtype", [
    (8000, "WAV", "PCM_16"),
    (16000, "WAV", "FLOAT"),
    (44100, "FLAC", "PCM_16"),
    (48000, "OGG", "VORBIS"),
    (44100, "WAV", "PCM_24"),
])
def test_load_audio_resamples_any_rate_and_keeps_the_pitch(tmp_path, sample_rate, fmt, subtype):
    seconds = 1.5
    path = tmp_path / f"tone.{fmt.lower()}"
    soundfile.write(path, sine(1000.0, seconds, sample_rate), sample_rate, format=fmt, subtype=subtype)
    loaded = audio.load_audio(path)
    assert loaded.dtype == np.float32 and loaded.ndim == 1
    assert len(loaded) == round(int(seconds * sample_rate) * SR / sample_rate)
    assert dominant_frequency(loaded, SR) == pytest.approx(1000.0, abs=1.0)
    assert np.abs(loaded).max() == pytest.approx(0.5, abs=0.05)


def test_load_audio_at_16k_int16_is_exact(tmp_path):
    samples = (np.random.default_rng(0).integers(-32768, 32767, size=SR // 2)).astype(np.int16)
    path = tmp_path / "pcm.wav"
    soundfile.write(path, samples, SR, subtype="PCM_16")
    np.testing.assert_array_equal(audio.load_audio(str(path)), samples / np.float32(32768))


def test_load_audio_downmixes_channels_by_averaging(tmp_path):
    left, right = sine(300.0, 1.0, SR), sine(700.0, 1.0, SR, amplitude=0.2)
    path = tmp_path / "stereo.wav"
    soundfile.write(path, np.stack([left, right], axis=1), SR, subtype="FLOAT")
    np.testing.assert_allclose(audio.load_audio(path), (left + right) / 2, atol=1e-7)


def test_load_audio_reads_bytes_and_file_objects():
    buffer = io.BytesIO()
    clip = sine(440.0, 0.5, 22050)
    soundfile.write(buffer, clip, 22050, format="FLAC")
    data = buffer.getvalue()
    from_bytes = audio.load_audio(data)
    from_file = audio.load_audio(io.BytesIO(data))
    assert len(from_bytes) == round(len(clip) * SR / 22050)
    np.testing.assert_array_equal(from_bytes, from_file)
    np.testing.assert_array_equal(audio.load_audio(data, sample_rate=22050), audio.load_audio(io.BytesIO(data), 22050))
    assert len(audio.load_audio(data, sample_rate=8000)) == round(len(clip) * 8000 / 22050)


def test_load_audio_errors_say_what_is_wrong(tmp_path):
    missing = tmp_path / "nope.wav"
    with pytest.raises(AudioError, match="not found.*nope.wav"):
        audio.load_audio(missing)
    with pytest.raises(AudioError, match="cannot decode"):
        audio.load_audio(b"this is not audio at all" * 20)
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(np.random.default_rng(0).bytes(4000))
    with pytest.raises(AudioError, match="cannot decode"):
        audio.load_audio(garbage)
    empty_file = tmp_path / "empty.wav"
    empty_file.write_bytes(b"")
    with pytest.raises(AudioError):
        audio.load_audio(empty_file)
    with pytest.raises(AudioError, match="empty"):
        audio.load_audio(b"")
    no_samples = tmp_path / "no_samples.wav"
    soundfile.write(no_samples, np.zeros(0, dtype=np.float32), SR)
    with pytest.raises(AudioError, match="no audio samples"):
        audio.load_audio(no_samples)
    nan = tmp_path / "nan.wav"
    soundfile.write(nan, np.array([0.0, np.nan, 0.1] * 100, dtype=np.float32), SR, subtype="FLOAT")
    with pytest.raises(AudioError, match="NaN"):
        audio.load_audio(nan)
    with pytest.raises(AudioError, match="directory"):
        audio.load_audio(tmp_path)
    with pytest.raises(AudioError, match="int"):
        audio.load_audio(12345)
    assert issubclass(AudioError, ValueError)


def test_resample_keeps_equal_rates_and_checks_rates():
    clip = sine(1000.0, 0.1, SR)
    assert audio.resample(clip, SR, SR) is clip
    assert len(audio.resample(clip, SR, 8000)) == len(clip) // 2
    with pytest.raises(ValueError, match="orig_sr"):
        audio.resample(clip, 0, SR)
    with pytest.raises(ValueError, match="target_sr"):
        audio.resample(clip, SR, 16000.5)


# ---------------------------------------------------------------------------------------------------------
# Splitting
# ---------------------------------------------------------------------------------------------------------


def assert_covers(ranges, length, max_samples):
    assert ranges[0][0] == 0 and ranges[-1][1] == length
    for (_, end), (next_start, _) in zip(ranges, ranges[1:]):
        assert end == next_start
    assert all(0 < end - start <= max_samples for start, end in ranges)


def test_split_long_audio_cuts_in_the_middle_of_the_quiet_gaps():
    rng = np.random.default_rng(0)
    seconds = 100
    signal = rng.uniform(-0.5, 0.5, seconds * SR).astype(np.float32)  # loud everywhere...
    gaps = [(26.0, 26.6), (54.2, 54.5), (81.0, 82.0)]  # ...but here, seconds
    for start, end in gaps:
        signal[int(start * SR): int(end * SR)] = 1e-4 * rng.standard_normal(int(end * SR) - int(start * SR))
    ranges = audio.split_long_audio(signal, max_seconds=30.0, search_seconds=5.0)
    assert_covers(ranges, len(signal), 30 * SR)
    cuts = [end / SR for _, end in ranges[:-1]]
    assert len(cuts) == len(gaps)
    for cut, (start, end) in zip(cuts, gaps):
        assert start + 0.02 < cut < end - 0.02  # inside the gap, clear of the loud edges
        assert cut == pytest.approx((start + end) / 2, abs=0.05)


def test_split_long_audio_without_pauses_still_covers_within_the_limit():
    signal = np.random.default_rng(1).standard_normal(65 * SR).astype(np.float32)
    ranges = audio.split_long_audio(signal, max_seconds=20.0, search_seconds=2.0)
    assert_covers(ranges, len(signal), 20 * SR)
    assert all(end - start >= 18 * SR for start, end in ranges[:-1])  # cut within the search window


def test_split_long_audio_short_and_edge_cases():
    assert audio.split_long_audio(np.zeros(0, dtype=np.float32)) == []
    assert audio.split_long_audio(np.zeros(10 * SR, dtype=np.float32)) == [(0, 10 * SR)]
    exactly = np.ones(30 * SR, dtype=np.float32)
    assert audio.split_long_audio(exactly, max_seconds=30.0) == [(0, 30 * SR)]
    silence = np.zeros(61 * SR, dtype=np.float32)  # all equally quiet: cuts stay within the limit
    assert_covers(audio.split_long_audio(silence, max_seconds=30.0), len(silence), 30 * SR)
    tiny = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    assert_covers(audio.split_long_audio(tiny, max_seconds=0.01, search_seconds=0.5), 1000, 160)
    with pytest.raises(ValueError):
        audio.split_long_audio(np.zeros((2, 100), dtype=np.float32))
    with pytest.raises(ValueError):
        audio.split_long_audio(silence, max_seconds=0)
