"""qasr.model.audio's pieces for a growing clip: frames from a given frame on, which frames are settled, the floor."""

import numpy as np
import pytest
import torch

from qasr.model import audio

from fakes import speech_clip

SR = audio.SAMPLE_RATE


def raw_frames(clip: np.ndarray, first: int = 0) -> torch.Tensor:
    """log10 mel frames of `clip` from `first` on, [mels, frames], computed from the samples they read."""
    tail = clip[audio.stft_start_sample(first):]
    log_spec, counts = audio.log_spectrogram_batch([tail], [clip.size], [first])
    return log_spec[0, :, : int(counts[0])]


@pytest.mark.parametrize("length", [161, 201, 400, 4000, SR + 77, int(SR * 8.5)])
def test_frames_from_any_first_frame_equal_the_whole_clips(length):
    clip = speech_clip(length / SR, seed=length)
    whole = raw_frames(clip)
    assert whole.shape == (audio.N_MELS, audio.num_frames(length))
    frames = whole.shape[1]
    for first in sorted({f for f in (0, 1, 2, 3, frames // 2, frames - 2, frames - 1, frames) if 0 <= f <= frames}):
        part = raw_frames(clip, first)
        assert part.shape == (audio.N_MELS, whole.shape[1] - first)
        torch.testing.assert_close(part, whole[:, first:], rtol=0, atol=1e-6)


def test_log_mel_is_the_floored_raw_frames():
    clip = speech_clip(3.0)
    clip[: SR // 2] = 0  # digital silence: floored
    raw = raw_frames(clip)
    assert torch.equal(audio.floor_log_spectrogram(raw, raw.max()), audio.log_mel(clip))


@pytest.mark.parametrize("length", [201, 360, 399, 400, 481, 16000, 16039, 16040, 16199])
def test_settled_frames_do_not_change_when_audio_is_appended_and_the_next_one_can(length):
    rng = np.random.default_rng(length)
    clip = rng.uniform(-0.5, 0.5, length + 4000).astype(np.float32)
    settled = audio.num_settled_frames(length)
    assert 0 < settled <= audio.num_frames(length)
    short = raw_frames(clip[:length])
    for extra in (1, 40, 160, 4000):
        longer = raw_frames(clip[: length + extra])
        torch.testing.assert_close(longer[:, :settled], short[:, :settled], rtol=0, atol=1e-6)
    if settled < short.shape[1]:  # the first unsettled frame read reflect padding that appended audio replaces
        # (by as little as the window's last weight, sin(pi / 400) ** 2, times one sample)
        assert not torch.equal(raw_frames(clip[: length + 4000])[:, settled], short[:, settled])


def test_short_clips_have_no_settled_frames_and_the_count_never_exceeds_the_frames():
    assert [audio.num_settled_frames(n) for n in (0, 1, 160, 200)] == [0, 0, 0, 0]
    for n in range(201, 2000, 7):
        settled = audio.num_settled_frames(n)
        assert settled <= audio.num_frames(n)
        assert (settled - 1) * audio.HOP_LENGTH + audio.N_FFT // 2 <= n  # its last frame's window lies in the clip


def test_bad_tails_are_refused():
    clip = speech_clip(1.0)
    with pytest.raises(ValueError, match="samples"):
        audio.log_spectrogram_batch([clip], [clip.size], [5])  # the whole clip given where a tail was due
    with pytest.raises(ValueError, match="outside"):
        audio.log_spectrogram_batch([clip[:0]], [clip.size], [audio.num_frames(clip.size) + 1])
