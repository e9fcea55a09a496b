"""qasr.model.aligner_repair: the same repaired times as the official fix_timestamp / parse_timestamp, exactly."""

import numpy as np
import pytest

from qasr.model.aligner_repair import WordTime, repair, word_times

official = pytest.importorskip("official", reason="tests/official.py needs transformers and qwen-asr")


@pytest.fixture(scope="module")
def official_processor():
    official.import_official()
    from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForceAlignProcessor

    return Qwen3ForceAlignProcessor()


def official_ms(classes, segment_ms=80.0) -> np.ndarray:
    """What the official hands fix_timestamp: an int64 tensor of classes times the segment, as numpy."""
    import torch

    return (torch.tensor(classes, dtype=torch.long) * segment_ms).numpy()


def test_repair_matches_the_official_on_random_sequences(official_processor):
    rng = np.random.default_rng(0)
    for trial in range(600):
        n = int(rng.integers(1, 70))
        kind = trial % 3
        if kind == 0:  # mostly rising with outliers: the shape a trained aligner gives
            classes = np.cumsum(rng.integers(0, 4, n)) + 10
            outliers = rng.random(n) < 0.15
            classes[outliers] = rng.integers(0, 5000, outliers.sum())
        elif kind == 1:  # few distinct values: many ties
            classes = rng.integers(0, 4, n)
        else:  # anything
            classes = rng.integers(0, 5000, n)
        ms = official_ms(classes.tolist())
        assert repair(ms.tolist()) == official_processor.fix_timestamp(ms), classes.tolist()


def test_word_times_match_the_official_parse_and_rounding(official_processor):
    rng = np.random.default_rng(1)
    for segment_ms in (80.0, 40.0, 12.5):
        for _ in range(100):
            words = [f"w{i}" for i in range(int(rng.integers(1, 30)))]
            classes = rng.integers(0, 5000, 2 * len(words)).tolist()
            expected = official_processor.parse_timestamp(words, official_ms(classes, segment_ms))
            expected = [(e["text"], round(e["start_time"] / 1000.0, 3), round(e["end_time"] / 1000.0, 3))
                        for e in expected]
            assert [tuple(w) for w in word_times(words, classes, segment_ms)] == expected


def test_repair_rules():
    assert repair([80.0, 160.0, 240.0]) == [80, 160, 240]  # monotonic: untouched
    assert repair([80.0, 4000.0, 160.0, 240.0]) == [80, 80, 160, 240]  # an outlier: the nearer neighbour, left on a tie
    assert repair([80.0, 160.0, 240.0, 0.0]) == [80, 160, 240, 240]  # at the end: the neighbour that exists
    assert repair([80.0, 160.0, 5.0, 4.0, 3.0, 480.0]) == [80, 160, 240, 320, 400, 480]  # three: spread linearly
    assert repair([100.0, 9.0, 8.0, 7.0, 200.0]) == [100, 125, 150, 175, 200]
    assert repair([80.0, 4000.0, 3000.0, 160.0, 240.0]) == [80, 80, 160, 160, 240]  # two: each its nearer one
    assert repair([4000.0, 80.0, 160.0]) == [80, 80, 160]  # at the start
    assert repair([]) == []


def test_word_times_pairs_start_and_end_per_word():
    times = word_times(["a", "b"], [1, 2, 3, 4], 80.0)
    assert times == [WordTime("a", 0.08, 0.16), WordTime("b", 0.24, 0.32)]
    assert times[0].word == "a" and times[1].end == 0.32
    with pytest.raises(ValueError, match="2 words need 4"):
        word_times(["a", "b"], [1, 2, 3], 80.0)
