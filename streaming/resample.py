"""Per-stream resampling to the model's 16 kHz (qasr.audio.SAMPLE_RATE), chunk by chunk.

`StreamResampler` keeps soxr's filter state between chunks, so the concatenated output of
`process()` calls plus `flush()` equals resampling the whole signal at once, in values and in
length. At 16 kHz in, it passes chunks through untouched.
"""

from __future__ import annotations

import numpy as np
import soxr

from qasr.audio import SAMPLE_RATE

MIN_RATE = 8_000  # Hz; telephony
MAX_RATE = 192_000  # Hz; studio interfaces


class StreamResampler:
    """Resamples one float32 mono stream from `input_rate` to `output_rate`. One instance per stream."""

    def __init__(self, input_rate: int, output_rate: int = SAMPLE_RATE, *, quality: str = "HQ") -> None:
        for name, rate in (("input_rate", input_rate), ("output_rate", output_rate)):
            if not isinstance(rate, (int, np.integer)) or not MIN_RATE <= rate <= MAX_RATE:
                raise ValueError(f"{name} must be an integer sample rate in {MIN_RATE}..{MAX_RATE} Hz, got {rate!r}")
        self.input_rate = int(input_rate)
        self.output_rate = int(output_rate)
        self._stream = None
        if self.input_rate != self.output_rate:
            self._stream = soxr.ResampleStream(self.input_rate, self.output_rate, 1, dtype="float32", quality=quality)
        self._flushed = False

    @property
    def is_identity(self) -> bool:
        return self._stream is None

    def process(self, chunk: np.ndarray) -> np.ndarray:
        """chunk: [n] float at input_rate -> [m] float32 at output_rate (m may be 0: soxr buffers)."""
        if self._flushed:
            raise RuntimeError("process() after flush(): the stream has ended; start a new StreamResampler")
        chunk = as_float32_mono(chunk)
        if self._stream is None:
            return chunk
        return self._stream.resample_chunk(chunk)

    def flush(self) -> np.ndarray:
        """End of stream: the output soxr still holds back ([m] float32). Call once."""
        if self._flushed:
            return np.zeros(0, dtype=np.float32)
        self._flushed = True
        if self._stream is None:
            return np.zeros(0, dtype=np.float32)
        return self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)


def as_float32_mono(samples: np.ndarray) -> np.ndarray:
    """Validate a 1-D float sample array (ValueError that says what to do otherwise) -> contiguous float32."""
    if type(samples) is np.ndarray and samples.dtype == np.float32 and samples.ndim == 1 and samples.flags.c_contiguous:
        return samples  # what every session feeds, per message: skip the general checks (~2 us each time)
    samples = np.asarray(samples)
    if samples.ndim != 1:
        raise ValueError(f"expected mono samples of shape [n], got shape {samples.shape}; downmix first")
    if not np.issubdtype(samples.dtype, np.floating):
        raise ValueError(
            f"expected float samples in [-1, 1], got dtype {samples.dtype}; for int16 PCM divide by 32768 first"
        )
    return np.ascontiguousarray(samples, dtype=np.float32)
