"""Audio basics every part of qasr shares, torch-free (numpy only): the model's sample rate, the wire encodings,
PCM decoding, downmixing and the "cut at the quietest point" rule.

    SAMPLE_RATE            16000 Hz: what the VAD and the model hear (everything else is resampled to it)
    ENCODINGS              wire encoding name -> bytes per sample ("s16le", "f32le", "mulaw", "alaw")
    decode_pcm(data, encoding, channels) -> float32 [frames, channels] in [-1, 1]
    downmix(samples)       [frames, channels] -> [frames] mono (the channels' mean)
    quietest_point(...)    where to cut a stretch of audio that must be split
"""

from __future__ import annotations

SAMPLE_RATE = 16000  # Hz; the one definition (the model, the VAD, timestamps, the clients' default)

from qasr.audio.pcm import ENCODINGS, AudioError, decode_pcm, downmix  # noqa: E402
from qasr.audio.quietest import quietest_point  # noqa: E402

__all__ = ["SAMPLE_RATE", "ENCODINGS", "AudioError", "decode_pcm", "downmix", "quietest_point"]
