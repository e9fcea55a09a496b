"""Deterministic speech-like test signals for benchmarks (voiced harmonic bursts with pauses, plus a noise floor)."""

from __future__ import annotations

import numpy as np

from qasr.audio import SAMPLE_RATE


def speech_like(seconds: float, seed: int = 0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """float32 mono: syllable-length voiced bursts (100-250 Hz pitch, 5 harmonics) separated by short pauses."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    out = 0.003 * rng.standard_normal(n)
    t = 0
    while t < n:
        length = int(rng.uniform(0.12, 0.35) * sample_rate)
        f0 = rng.uniform(100, 250)
        tt = np.arange(min(length, n - t)) / sample_rate
        burst = sum(np.sin(2 * np.pi * f0 * k * tt + rng.uniform(0, 6.28)) / k for k in range(1, 6))
        out[t : t + tt.size] += 0.2 * burst * np.hanning(tt.size)
        t += length + int(rng.uniform(0.03, 0.25) * sample_rate)
    return out.astype(np.float32)
