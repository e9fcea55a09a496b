"""The finiteness check an admission makes on each clip it stages (`host_copy.all_finite`): exact wherever the bad
sample is and whatever the dtype, including finite audio whose sum overflows; and prompting.validate's cheap checks
leave it to the admission."""

import numpy as np
import pytest

from qasr.engine.options import EngineOptions
from qasr.engine.host_copy import all_finite
from qasr.engine.prompting import validate
from qasr.engine.request import DecodeRequest


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_bad_sample_anywhere_is_found(dtype, bad):
    audio = np.random.default_rng(0).normal(0, 0.1, 48_000).astype(dtype)
    assert all_finite(audio)
    for where in (0, 1, 12_345, audio.size - 1):
        spoiled = audio.copy()
        spoiled[where] = bad
        assert not all_finite(spoiled)


def test_infinities_of_both_signs_and_nans_together_are_found():
    audio = np.zeros(1000, np.float32)
    audio[[3, 500]] = [np.inf, -np.inf]  # their sum is NaN, not finite either
    assert not all_finite(audio)
    audio[[3, 500]] = [np.nan, 1.0]
    assert not all_finite(audio)


def test_finite_audio_whose_sum_overflows_is_finite():
    loud = np.full(1000, 3e38, np.float32)  # each sample finite, the float32 sum is not
    with np.errstate(over="ignore"):
        assert np.isinf(loud.sum())
    assert all_finite(loud)
    loud[[0, 1]] = [-3e38, np.finfo(np.float32).max]
    assert all_finite(loud)
    loud[999] = np.nan
    assert not all_finite(loud)


def test_other_arrays_are_checked_sample_by_sample():
    assert all_finite(np.arange(100, dtype=np.int16))
    grid = np.zeros((4, 100), np.float32)
    assert all_finite(grid)
    grid[2, 50] = np.inf
    assert not all_finite(grid)
    assert not all_finite(np.zeros(2000, np.float32)[::2] + np.float32(np.nan))


def test_validate_leaves_the_samples_to_the_admission():
    """validate runs when a request is added, where a pass over every sample held the device idle at the start of an
    offline batch: a NaN passes here and is refused when the admission stages the clip (tests/engine/test_engine.py)."""
    audio = np.zeros(16_000, np.float32)
    audio[8_000] = np.nan
    validate(DecodeRequest(audio=audio), EngineOptions())
    with pytest.raises(ValueError, match="too short"):
        validate(DecodeRequest(audio=audio[:10]), EngineOptions())
