"""From the aligner's timestamp classes to word times: class -> ms, the official monotonic repair, ms -> seconds.

Each word has two timestamp slots (start, end); their classes times `timestamp_segment_time` (80 ms) are times from
the start of the clip. The argmax is not always monotonic, so the official `fix_timestamp` (qwen-asr 0.0.6) repairs
the sequence: a longest non-decreasing subsequence marks the values it trusts; every run of other values is
replaced - a run of at most two takes the value of its nearer trusted neighbour (the left one on a tie, the one that
exists at an edge), a longer run is spread linearly between its two neighbours (or copies the one that exists) -
and the results are truncated to whole ms. This module does the same arithmetic in the same order, so its times are
identical, not merely close.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


class WordTime(NamedTuple):
    word: str
    start: float  # seconds from the start of the aligned clip, to the ms (the official rounds to 3 decimals)
    end: float


def word_times(words: Sequence[str], classes: Sequence[int], segment_ms: float) -> list[WordTime]:
    """Word times from the classes of the 2 * len(words) timestamp slots (start, end per word)."""
    if len(classes) != 2 * len(words):
        raise ValueError(f"{len(words)} words need {2 * len(words)} timestamp classes, got {len(classes)}")
    # class * segment as the official computes it: an int64 tensor times a Python float, which is float32
    ms = (np.asarray(classes, dtype=np.float32) * np.float32(segment_ms)).tolist()
    fixed = repair(ms)
    return [
        WordTime(word, round(fixed[2 * i] / 1000.0, 3), round(fixed[2 * i + 1] / 1000.0, 3))
        for i, word in enumerate(words)
    ]


def repair(values: Sequence[float]) -> list[int]:
    """The official monotonic repair of a timestamp sequence (ms), truncated to whole ms."""
    values = list(values)
    if not values:
        return []
    trusted = _longest_non_decreasing(values)
    result = list(values)
    n, i = len(values), 0
    while i < n:
        if trusted[i]:
            i += 1
            continue
        j = i
        while j < n and not trusted[j]:
            j += 1
        # neighbours come from `result`, which only ever changes at untrusted positions: the trusted values
        left = next((result[k] for k in range(i - 1, -1, -1) if trusted[k]), None)
        right = next((result[k] for k in range(j, n) if trusted[k]), None)
        count = j - i
        for k in range(i, j):
            if left is None:
                result[k] = right
            elif right is None:
                result[k] = left
            elif count <= 2:
                result[k] = left if k - (i - 1) <= j - k else right
            else:
                result[k] = left + (right - left) / (count + 1) * (k - i + 1)
        i = j
    return [int(value) for value in result]


def _longest_non_decreasing(values: list[float]) -> list[bool]:
    """Marks of one longest non-decreasing subsequence: the one the official O(n^2) search finds.

    length[i] = 1 + the longest chain ending before i at a value <= values[i]; its parent is the first such j with
    the longest chain (the official loop only replaces on a strictly longer chain); the chain kept ends at the first
    i of the greatest length. Each step is one vectorised pass over the earlier values.
    """
    data = np.asarray(values, dtype=np.float64)
    n = len(data)
    length = np.ones(n, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    for i in range(1, n):
        chains = np.where(data[:i] <= data[i], length[:i], 0)
        best = int(chains.argmax())  # the first j of the longest chain
        if chains[best] > 0:
            length[i] = chains[best] + 1
            parent[i] = best
    trusted = [False] * n
    i = int(length.argmax())
    while i != -1:
        trusted[i] = True
        i = int(parent[i])
    return trusted
