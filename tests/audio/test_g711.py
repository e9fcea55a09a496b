"""G.711 tables against an encoder written from the standard's segment definition (and against audioop where the
interpreter still has it); qasr's own encoder against a brute-force search for the nearest level."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from qasr.audio import decode_pcm
from qasr.audio import g711
from qasr.audio.g711 import ALAW_TO_LINEAR, MULAW_TO_LINEAR


def encode_mulaw(x: int) -> int:
    """ITU-T G.711 mu-law: 14-bit magnitude, biased by 33, 8 segments of 16 steps, bits inverted on the wire."""
    magnitude = min(abs(x) >> 2, 8158)  # 16-bit -> 14-bit, clipped to the largest level
    biased = magnitude + 33
    segment = biased.bit_length() - 6  # 33..63 -> 0, 64..127 -> 1, ... 4096..8191 -> 7
    step = (biased >> (segment + 1)) & 0x0F
    sign = 0x80 if x >= 0 else 0x00
    return sign | (~((segment << 4) | step) & 0x7F)


def encode_alaw(x: int) -> int:
    """ITU-T G.711 A-law: 13-bit magnitude, segment 0 linear like segment 1, even bits inverted on the wire."""
    magnitude = x >> 3 if x >= 0 else (-x - 1) >> 3
    if magnitude < 32:
        segment, step = 0, (magnitude >> 1) & 0x0F
    else:
        segment = min(magnitude.bit_length() - 5, 7)
        step = 0x0F if magnitude >= 4096 else (magnitude >> segment) & 0x0F
    sign = 0x80 if x >= 0 else 0x00
    return (sign | (segment << 4) | step) ^ 0x55


@pytest.mark.parametrize("table, encode, name", [(MULAW_TO_LINEAR, encode_mulaw, "mulaw"),
                                                 (ALAW_TO_LINEAR, encode_alaw, "alaw")])
def test_every_code_decodes_to_a_level_that_encodes_back_to_it(table, encode, name):
    for code in range(256):
        if name == "mulaw" and code == 0x7F:  # "negative zero": decodes to 0, which encodes as 0xFF
            assert table[code] == 0 and encode(0) == 0xFF
            continue
        assert encode(int(table[code])) == code, hex(code)


@pytest.mark.parametrize("table, encode", [(MULAW_TO_LINEAR, encode_mulaw), (ALAW_TO_LINEAR, encode_alaw)])
def test_any_sample_comes_back_within_half_a_step(table, encode):
    x = np.arange(-32768, 32768)
    decoded = table[[encode(int(value)) for value in x]].astype(np.int64)
    error = np.abs(decoded - x)
    step = np.abs(decoded) // 16  # each segment's step is 1/16 of its span; the top segment also clips
    inside = np.abs(x) < 31000
    assert np.all(error[inside] <= np.maximum(step[inside], 16))
    assert table.max() < 32768 and table.min() >= -32768 and (table == 0).sum() <= 2


def test_tables_match_audioop_where_it_exists():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")  # gone in Python 3.13
    codes = bytes(range(256))
    np.testing.assert_array_equal(MULAW_TO_LINEAR, np.frombuffer(audioop.ulaw2lin(codes, 2), "<i2"))
    np.testing.assert_array_equal(ALAW_TO_LINEAR, np.frombuffer(audioop.alaw2lin(codes, 2), "<i2"))


def test_g711_bytes_decode_to_float_frames():
    codes = bytes([0xFF, 0x80, 0x00, 0x7F])
    samples = decode_pcm(codes, "mulaw", channels=2)
    assert samples.shape == (2, 2) and samples.dtype == np.float32
    np.testing.assert_array_equal(samples.ravel(), MULAW_TO_LINEAR[list(codes)] / 32768.0)
    assert samples[0, 0] == 0.0 and samples[0, 1] == pytest.approx(32124 / 32768)
    np.testing.assert_array_equal(decode_pcm(bytes([0xD5, 0x55]), "alaw")[:, 0], [8 / 32768, -8 / 32768])


TABLES = {"mulaw": MULAW_TO_LINEAR, "alaw": ALAW_TO_LINEAR}


@pytest.mark.parametrize("encoding", ["mulaw", "alaw"])
def test_encoding_picks_the_code_whose_decoded_level_is_nearest(encoding):
    levels = np.unique(TABLES[encoding]).astype(np.float64) / 32768.0
    rng = np.random.default_rng(0)
    samples = np.concatenate([rng.uniform(-1.1, 1.1, 20000), rng.normal(0, 0.01, 20000),  # quiet: the fine steps
                              levels, (levels[1:] + levels[:-1]) / 2 + 1e-7, [0.0, -1.0, 1.0]]).astype(np.float32)
    codes = g711.encode(samples, encoding)
    assert isinstance(codes, bytes) and len(codes) == len(samples)
    decoded = decode_pcm(codes, encoding)[:, 0].astype(np.float64)
    nearest = np.abs(samples[:, None].astype(np.float64) - levels[None, :]).min(axis=1)
    np.testing.assert_array_equal(np.abs(decoded - samples), nearest)


@pytest.mark.parametrize("encoding", ["mulaw", "alaw"])
def test_every_decoded_level_encodes_back_to_its_code(encoding):
    codes = np.frombuffer(g711.encode(decode_pcm(bytes(range(256)), encoding)[:, 0], encoding), dtype=np.uint8)
    expected = np.arange(256)
    if encoding == "mulaw":
        expected[0x7F] = 0xFF  # "negative zero" decodes to 0, which is sent as positive zero
    np.testing.assert_array_equal(codes, expected)


def test_encoding_zero_and_out_of_range_samples_gives_the_standards_codes():
    assert g711.encode(np.array([0.0, 2.0, -2.0]), "mulaw") == bytes([0xFF, 0x80, 0x00])  # clipped to the extremes
    assert g711.encode(np.array([0.0], dtype=np.float32), "alaw") == bytes([0xD5])  # halfway of -8, +8: up


@pytest.mark.parametrize("samples, encoding, match", [(np.array([0.1, np.nan]), "mulaw", "NaN"),
                                                      (np.array([np.inf]), "alaw", "infinite"),
                                                      (np.array([1, 2], dtype=np.int16), "mulaw", "float"),
                                                      (np.zeros(2), "s16le", "mulaw")])
def test_encoding_refuses_what_it_cannot_encode(samples, encoding, match):
    with pytest.raises(ValueError, match=match):
        g711.encode(samples, encoding)
