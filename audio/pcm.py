"""Raw PCM from the wire -> float32 samples, for every encoding a client (or a telephony adapter) may send."""

from __future__ import annotations

import numpy as np

from qasr.audio import g711


class AudioError(ValueError):
    """Audio that cannot be used: missing, unreadable, empty, malformed or containing NaN/inf."""


ENCODINGS = {  # wire encoding -> bytes per sample
    "s16le": 2,  # 16-bit signed little-endian
    "f32le": 4,  # 32-bit float little-endian, in [-1, 1]
    "mulaw": 1,  # G.711 mu-law (telephony: North America, Japan)
    "alaw": 1,  # G.711 A-law (telephony: elsewhere)
}


def decode_pcm(data: bytes | bytearray | memoryview, encoding: str, channels: int = 1) -> np.ndarray:
    """Decode interleaved PCM into float32 [frames, channels] in [-1, 1] (a fresh, writable array).

    Raises AudioError on an unknown encoding, bytes that are not whole samples on every channel, or (f32le)
    NaN/inf samples; f32le samples beyond full scale are clipped to [-1, 1].
    """
    if encoding not in ENCODINGS:
        raise AudioError(f"unknown PCM encoding {encoding!r}: use one of {', '.join(ENCODINGS)}")
    if isinstance(channels, bool) or not isinstance(channels, (int, np.integer)) or channels < 1:
        raise AudioError(f"channels must be a positive integer, got {channels!r}")
    frame_bytes = ENCODINGS[encoding] * channels
    if len(data) % frame_bytes:
        raise AudioError(f"audio must hold whole samples on all channels ({frame_bytes} bytes each for {channels} x "
                         f"{encoding}), got {len(data)} bytes")
    if encoding == "s16le":  # one pass; 1/32768 is a power of two, so this equals dividing
        samples = np.multiply(np.frombuffer(data, dtype="<i2"), np.float32(1.0 / 32768.0), dtype=np.float32)
    elif encoding == "f32le":
        samples = np.frombuffer(data, dtype="<f4").astype(np.float32)  # native byte order, writable copy
        if not np.isfinite(samples).all():
            raise AudioError("f32le audio contains NaN or infinite samples")
        np.clip(samples, -1.0, 1.0, out=samples)  # a float source can overshoot full scale; the model expects [-1, 1]
    else:
        samples = g711.decode(data, encoding)
    return samples.reshape(-1, channels)


def downmix(samples: np.ndarray) -> np.ndarray:
    """[frames, channels] float -> [frames] float32 mono, the mean of the channels."""
    samples = np.asarray(samples)
    if samples.ndim != 2 or samples.shape[1] < 1:
        raise AudioError(f"expected samples of shape [frames, channels], got shape {samples.shape}")
    if samples.shape[1] == 1:
        return np.ascontiguousarray(samples[:, 0], dtype=np.float32)
    return samples.mean(axis=1, dtype=np.float32)
