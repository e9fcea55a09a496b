"""Test doubles for the server and session tests: speech-like synthetic audio, a stand-in sounddevice, and the
fake engine (it lives in qasr.engine.fake, re-exported here so tests keep importing it from `fakes`).

`speech_like` builds voiced harmonic bursts separated by silence, which webrtcvad cuts where the pauses are.
"""

from __future__ import annotations

import types

import numpy as np

from qasr.engine.fake import FAKE_TIMINGS_MS, FakeCall, FakeEngine, describe_audio  # noqa: F401 (re-exported)

SAMPLE_RATE = 16000


def stand_in_sounddevice(input_stream) -> types.SimpleNamespace:
    """The part of the sounddevice module MicrophoneSource uses, with one 16 kHz mono device and `input_stream` as
    its InputStream class (constructed with callback=, blocksize=, channels=, ...)."""

    class PortAudioError(Exception):
        pass

    device = {"name": "stand-in microphone", "default_samplerate": 16000.0, "max_input_channels": 1}
    return types.SimpleNamespace(PortAudioError=PortAudioError, query_devices=lambda *args, **kwargs: device,
                                 check_input_settings=lambda *args, **kwargs: None, InputStream=input_stream,
                                 default=types.SimpleNamespace(device=(0, 0)))


# ---------------------------------------------------------------------------------------------------------
# Speech-like audio
# ---------------------------------------------------------------------------------------------------------


def voiced_burst(seconds: float, *, f0: float = 140.0, sample_rate: int = SAMPLE_RATE, seed: int = 0) -> np.ndarray:
    """A vowel-like sound: harmonics of a wobbling f0 under two formant bumps, with soft 20 ms edges."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    t = np.arange(n) / sample_rate
    pitch = f0 * (1.0 + 0.05 * np.sin(2 * np.pi * 3.0 * t))  # slow vibrato
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    signal = np.zeros(n)
    for k in range(1, 25):
        frequency = k * f0
        if frequency > 0.45 * sample_rate:
            break
        formants = np.exp(-((frequency - 700) / 300) ** 2) + 0.6 * np.exp(-((frequency - 1800) / 400) ** 2)
        signal += (0.2 + formants) / k * np.sin(k * phase + rng.uniform(0, 2 * np.pi))
    signal *= 1.0 + 0.3 * np.sin(2 * np.pi * 4.0 * t)  # syllable-rate amplitude modulation
    edge = min(int(0.02 * sample_rate), n // 2)
    if edge:
        ramp = np.linspace(0.0, 1.0, edge)
        signal[:edge] *= ramp
        signal[n - edge:] *= ramp[::-1]
    return (0.3 * signal / max(np.abs(signal).max(), 1e-9)).astype(np.float32)


def speech_clip(seconds: float, seed: int = 0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Speech-like audio: voiced syllables (gliding pitch with harmonics, ~4 per second), pauses, a little noise."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    t = np.arange(n) / sample_rate
    f0 = 120 + 60 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6))  # Hz
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 20))
    syllables = np.clip(np.sin(2 * np.pi * rng.uniform(3, 5) * t + rng.uniform(0, 6)), 0, None) ** 2
    pauses = np.sin(2 * np.pi * 0.3 * t + rng.uniform(0, 6)) > -0.6
    noise = 0.02 * rng.standard_normal(n) * syllables + 1e-4 * rng.standard_normal(n)
    signal = 0.3 * voice * syllables * pauses + noise
    return signal.astype(np.float32)


def speech_like(pattern: list[tuple[str, float]], *, sample_rate: int = SAMPLE_RATE, noise: float = 1e-4,
                seed: int = 0) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Audio from [("speech", seconds) | ("silence", seconds), ...] and the true (start, end) of each burst.

    Silence carries a little white noise (real microphones are never digital zero).
    """
    rng = np.random.default_rng(seed)
    pieces, truth, position = [], [], 0
    for index, (kind, seconds) in enumerate(pattern):
        n = int(round(seconds * sample_rate))
        if kind == "speech":
            piece = voiced_burst(seconds, f0=120.0 + 15 * (index % 4), sample_rate=sample_rate, seed=seed + index)
            truth.append((position / sample_rate, (position + n) / sample_rate))
        elif kind == "silence":
            piece = np.zeros(n, dtype=np.float32)
        else:
            raise ValueError(f"pattern kinds are 'speech' and 'silence', got {kind!r}")
        pieces.append(piece + rng.normal(0.0, noise, n).astype(np.float32))
        position += n
    return np.concatenate(pieces).astype(np.float32), truth


def to_s16le(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
