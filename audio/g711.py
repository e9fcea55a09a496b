"""G.711 mu-law and A-law (ITU-T G.711), decoding and encoding by 256-entry tables: what telephony streams carry.

Each table maps a code byte to the 16-bit linear sample the standard assigns it (the classic expansion also used by
libsndfile, sox and Python's former `audioop`), scaled to float32 in [-1, 1). tests/audio/test_g711.py checks the
tables against an encoder written from the standard's segment definition. `encode` picks, for each sample, the code
whose decoded level is nearest, so decode(encode(x)) is the closest value the server's decoder can produce.
"""

from __future__ import annotations

import numpy as np

_SIGN = 0x80
_SEGMENT = 0x70  # 3 bits: the segment (exponent)
_STEP = 0x0F  # 4 bits: the step within the segment (mantissa)
_MULAW_BIAS = 0x84  # 132: mu-law segments start at 33 (x4 in 16-bit scale) so segment 0 needs no special case


def _mulaw_to_linear(code: int) -> int:
    code = ~code & 0xFF  # mu-law bytes are sent inverted
    magnitude = (((code & _STEP) << 3) + _MULAW_BIAS) << ((code & _SEGMENT) >> 4)
    return _MULAW_BIAS - magnitude if code & _SIGN else magnitude - _MULAW_BIAS


def _alaw_to_linear(code: int) -> int:
    code ^= 0x55  # A-law bytes have their even bits inverted
    segment = (code & _SEGMENT) >> 4
    magnitude = ((code & _STEP) << 4) + 8  # the middle of the step
    if segment:
        magnitude = (magnitude + 0x100) << (segment - 1)
    return magnitude if code & _SIGN else -magnitude


MULAW_TO_LINEAR = np.array([_mulaw_to_linear(code) for code in range(256)], dtype=np.int16)  # [256]
ALAW_TO_LINEAR = np.array([_alaw_to_linear(code) for code in range(256)], dtype=np.int16)  # [256]
_FLOAT_TABLES = {"mulaw": MULAW_TO_LINEAR.astype(np.float32) / np.float32(32768.0),
                 "alaw": ALAW_TO_LINEAR.astype(np.float32) / np.float32(32768.0)}


def decode(data: bytes | bytearray | memoryview, encoding: str) -> np.ndarray:
    """G.711 bytes ("mulaw" or "alaw") -> float32 [n] in [-1, 1)."""
    return _FLOAT_TABLES[encoding].take(np.frombuffer(data, dtype=np.uint8))  # take: ~2x indexing's speed on 20 ms


def _nearest_code_search(table: np.ndarray, zero_code: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(midpoints [L-1], codes [L]) over the table's L distinct levels, ascending: the sample x encodes as
    codes[searchsorted(midpoints, x, "right")] (halfway goes up, so A-law's 0 is +8, 0xD5, as G.711 has it).
    The level two codes share (mu-law's +0 and -0) keeps `zero_code`."""
    levels = table.astype(np.float32) / np.float32(32768.0)
    distinct = np.unique(levels)  # ascending
    codes = np.array([zero_code if level == 0 else int(np.flatnonzero(levels == level)[0]) for level in distinct],
                     dtype=np.uint8)
    midpoints = (distinct[:-1].astype(np.float64) + distinct[1:]) / 2  # float64: exact halfway of two float32s
    return midpoints, codes


_NEAREST = {"mulaw": _nearest_code_search(MULAW_TO_LINEAR, zero_code=0xFF),  # 0xFF: +0, what G.711 encoders send
            "alaw": _nearest_code_search(ALAW_TO_LINEAR)}  # A-law has no level 0


def encode(samples: np.ndarray, encoding: str) -> bytes:
    """float [n] (clipped to the outermost levels) -> G.711 bytes ("mulaw" or "alaw"), one per sample, each the code
    whose decoded level is nearest. Raises ValueError on NaN/inf samples or an unknown encoding."""
    if encoding not in _NEAREST:
        raise ValueError(f"G.711 encoding must be 'mulaw' or 'alaw', got {encoding!r}")
    samples = np.asarray(samples)
    if not np.issubdtype(samples.dtype, np.floating):
        raise ValueError(f"G.711 encodes float samples in [-1, 1], got {samples.dtype}")
    if not np.isfinite(samples).all():
        raise ValueError("cannot G.711-encode NaN or infinite samples")
    midpoints, codes = _NEAREST[encoding]
    return codes.take(np.searchsorted(midpoints, samples.ravel(), side="right")).tobytes()
