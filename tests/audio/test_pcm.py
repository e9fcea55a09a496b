"""PCM decoding and downmixing shared by the server and the clients."""

from __future__ import annotations

import numpy as np
import pytest

from qasr.audio import ENCODINGS, SAMPLE_RATE, AudioError, decode_pcm, downmix


def test_the_constants():
    assert SAMPLE_RATE == 16000
    assert ENCODINGS == {"s16le": 2, "f32le": 4, "mulaw": 1, "alaw": 1}


def test_decode_pcm_decodes_the_wire_encodings():
    ints = np.array([0, 1, -1, 32767, -32768, 16384], dtype="<i2")
    np.testing.assert_array_equal(decode_pcm(ints.tobytes(), "s16le")[:, 0], ints.astype(np.float32) / 32768)
    floats = np.array([0.0, 0.5, -0.25, 1.0], dtype="<f4")
    decoded = decode_pcm(floats.tobytes(), "f32le")
    np.testing.assert_array_equal(decoded[:, 0], floats)
    assert decoded.dtype == np.float32 and decoded.flags.writeable and decoded.shape == (4, 1)
    assert decode_pcm(b"", "s16le").shape == (0, 1)


def test_f32le_beyond_full_scale_is_clipped():
    """Found by the nightly fuzz: 2.0 went through to the model, which expects [-1, 1]."""
    floats = np.array([2.0, -3.5, 0.25, 1.0000001], dtype="<f4")
    np.testing.assert_array_equal(decode_pcm(floats.tobytes(), "f32le")[:, 0], [1.0, -1.0, 0.25, 1.0])


def test_interleaved_channels_become_columns():
    frames = np.array([[1, 2, 3], [-4, -5, -6]], dtype="<i2")  # [frames, channels]
    np.testing.assert_array_equal(decode_pcm(frames.tobytes(), "s16le", 3) * 32768, frames)


@pytest.mark.parametrize("data, encoding, channels, match", [
    (b"\x00\x01\x02", "s16le", 1, "whole samples"),
    (b"\x00" * 6, "f32le", 1, "whole samples"),
    (b"\x00" * 6, "s16le", 2, "4 bytes each for 2 x s16le"),
    (b"\x00" * 3, "mulaw", 2, "whole samples"),
    (b"\x00\x00", "s24le", 1, "s16le, f32le, mulaw, alaw"),
    (np.array([0.0, np.inf], dtype="<f4").tobytes(), "f32le", 1, "NaN"),
    (b"\x00\x00", "s16le", 0, "channels"),
])
def test_decode_pcm_refuses_what_it_cannot_decode(data, encoding, channels, match):
    with pytest.raises(AudioError, match=match):
        decode_pcm(data, encoding, channels)


def test_downmix_averages_the_channels():
    frames = np.array([[0.5, 0.25], [-1.0, 1.0], [0.2, 0.2]], np.float32)
    np.testing.assert_allclose(downmix(frames), [0.375, 0.0, 0.2], rtol=1e-6)
    mono = downmix(frames[:, :1])
    assert mono.dtype == np.float32 and mono.shape == (3,) and mono.flags.c_contiguous
    six = np.tile(np.arange(6, dtype=np.float32), 4).reshape(4, 6)
    np.testing.assert_allclose(downmix(six), np.full(4, 2.5))
    with pytest.raises(AudioError, match="frames, channels"):
        downmix(np.zeros(4, np.float32))
