"""Where to cut audio that must be split (a segment at its length limit, a long file): the quietest point."""

from __future__ import annotations

import numpy as np


def quietest_point(audio: np.ndarray, earliest: int, latest: int, window: int) -> int:
    """A cut position in [earliest, latest] (indices into `audio`), in the middle of its quietest stretch.

    The energy at a position is the mean power of the `window` samples around it (clipped to `audio`); every
    position within 1% of the energy range above the minimum counts as quiet, and the cut lands in the middle of
    the longest quiet run, so a pause is cut in its middle rather than at the edge of a word. Only
    audio[earliest - window // 2 : latest + window // 2] is read: the answer does not depend on the audio beyond.
    """
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise ValueError(f"expected 1-D mono audio, got shape {audio.shape}")
    if not 0 <= earliest <= latest <= len(audio) or window < 1:
        raise ValueError(f"need 0 <= earliest <= latest <= len(audio) ({len(audio)}) and window >= 1, got "
                         f"earliest {earliest}, latest {latest}, window {window}")
    half = window // 2
    lo, hi = max(earliest - half, 0), min(latest + half, audio.shape[0])
    stretch = audio[lo:hi].astype(np.float64)
    energy_sum = np.concatenate([[0.0], np.cumsum(stretch * stretch)])  # prefix sums of squares
    cuts = np.arange(earliest, latest + 1)
    left = np.clip(cuts - half, lo, hi) - lo
    right = np.clip(cuts + window - half, lo, hi) - lo
    energy = (energy_sum[right] - energy_sum[left]) / np.maximum(right - left, 1)  # mean power around each cut

    floor = energy.min()
    quiet = energy <= floor + 0.01 * (energy.max() - floor)
    # runs of consecutive quiet positions: pick the longest, cut in its middle
    edges = np.flatnonzero(np.diff(np.concatenate([[0], quiet.astype(np.int8), [0]])))
    run_starts, run_ends = edges[0::2], edges[1::2]  # [start, end) in cuts' indices
    longest = int(np.argmax(run_ends - run_starts))
    return int(cuts[(run_starts[longest] + run_ends[longest] - 1) // 2])
