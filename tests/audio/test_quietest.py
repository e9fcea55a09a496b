"""The one "cut at the quietest point" rule (the VAD's max-length cut and the offline splitter use it)."""

from __future__ import annotations

import numpy as np
import pytest

from qasr.audio import quietest_point


def test_the_cut_lands_in_the_middle_of_the_pause():
    rng = np.random.default_rng(0)
    audio = rng.uniform(-0.5, 0.5, 10_000).astype(np.float32)
    audio[6000:7000] = 1e-4 * rng.standard_normal(1000)
    assert quietest_point(audio, 1000, 9000, 400) == pytest.approx(6500, abs=50)


def test_only_the_window_and_half_a_window_around_it_are_read():
    rng = np.random.default_rng(1)
    audio = rng.uniform(-0.5, 0.5, 10_000).astype(np.float32)
    audio[3000:3500] = 0.0
    cut = quietest_point(audio, 2000, 5000, 200)
    changed = audio.copy()
    changed[:1900] = 0.0  # silence outside what the cut may read
    changed[5100:] = 0.0
    assert quietest_point(changed, 2000, 5000, 200) == cut == pytest.approx(3250, abs=20)


def test_a_window_without_pauses_still_gives_a_cut_inside_it():
    audio = np.ones(1000, np.float32)
    assert 100 <= quietest_point(audio, 100, 200, 30) <= 200
    assert quietest_point(audio, 7, 7, 30) == 7


@pytest.mark.parametrize("args", [(np.zeros((2, 10)), 0, 1, 1), (np.zeros(10), 5, 4, 1), (np.zeros(10), 0, 11, 1),
                                  (np.zeros(10), 0, 5, 0)])
def test_bad_arguments_are_refused(args):
    with pytest.raises(ValueError):
        quietest_point(*args)
