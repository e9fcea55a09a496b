"""Streaming resampling equals resampling the whole signal at once (downmixing: tests/audio/test_pcm.py)."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from qasr.streaming.resample import StreamResampler


def chirp(rate: int, seconds: float = 1.3) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * (100 + 1500 * t) * t)).astype(np.float32)


def resample_in_pieces(resampler: StreamResampler, signal: np.ndarray, piece: int) -> np.ndarray:
    outputs = [resampler.process(signal[start : start + piece]) for start in range(0, len(signal), piece)]
    return np.concatenate([*outputs, resampler.flush()])


@pytest.mark.parametrize("rate", [8000, 11025, 22050, 44100, 48000, 96000, 192000])
@pytest.mark.parametrize("piece", [1, 37, 160, 4000])
def test_streaming_equals_whole_signal(rate, piece):
    signal = chirp(rate)
    whole = soxr.resample(signal, rate, 16000)
    streamed = resample_in_pieces(StreamResampler(rate), signal, piece)
    assert streamed.dtype == np.float32
    assert len(streamed) == len(whole)
    np.testing.assert_allclose(streamed, whole, atol=1e-5)
    assert abs(len(streamed) - len(signal) * 16000 / rate) <= 1


def test_resampled_tone_keeps_its_frequency():
    rate = 44100
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)).astype(np.float32)
    out = resample_in_pieces(StreamResampler(rate), tone, 1024)
    spectrum = np.abs(np.fft.rfft(out[2000:-2000] * np.hanning(len(out) - 4000)))
    peak_hz = np.argmax(spectrum) * 16000 / (len(out) - 4000)
    assert abs(peak_hz - 440) < 2


def test_16k_passes_through_untouched():
    resampler = StreamResampler(16000)
    assert resampler.is_identity
    chunk = chirp(16000, 0.1)
    np.testing.assert_array_equal(resampler.process(chunk), chunk)
    assert resampler.process(chunk.astype(np.float64)).dtype == np.float32
    assert len(resampler.flush()) == 0


def test_other_output_rates():
    signal = chirp(16000)
    streamed = resample_in_pieces(StreamResampler(16000, 48000), signal, 333)
    np.testing.assert_allclose(streamed, soxr.resample(signal, 16000, 48000), atol=1e-5)


@pytest.mark.parametrize("rate", [7999, 192001, 0, -16000, 44100.5, "16000", None])
def test_unsupported_rates_are_refused(rate):
    with pytest.raises(ValueError, match="8000..192000"):
        StreamResampler(rate)
    with pytest.raises(ValueError, match="output_rate"):
        StreamResampler(16000, rate)


def test_process_checks_its_input_and_the_stream_end():
    resampler = StreamResampler(48000)
    with pytest.raises(ValueError, match="shape"):
        resampler.process(np.zeros((10, 2), np.float32))
    with pytest.raises(ValueError, match="int16"):
        resampler.process(np.zeros(10, np.int16))
    resampler.flush()
    assert len(resampler.flush()) == 0
    with pytest.raises(RuntimeError, match="flush"):
        resampler.process(np.zeros(10, np.float32))
