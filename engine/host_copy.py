"""Audio samples into one host buffer, each clip checked finite as it lands there, on several threads when there are
many (numpy lets go of the GIL while it copies): an admission stages all its clips' samples in pinned memory for one
copy to the device. On one thread that copy held 12% of the engine thread in an offline run of 512 rows, and the
finiteness check, then made when a request was added (with the device idle at the start of an offline batch), 8%
(py-spy on the H200, session 21)."""

from __future__ import annotations

import concurrent.futures
import functools
import os

import numpy as np

PARALLEL_COPY_SAMPLES = 2_000_000  # below this (about two minutes of audio) one thread copies
COPY_THREADS = 4


@functools.cache
def _copy_threads() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="qasr-copy")


os.register_at_fork(after_in_child=_copy_threads.cache_clear)  # a forked child has none of the parent's threads


def all_finite(audio: np.ndarray) -> bool:
    """Whether every sample is finite. For 1-D float audio, one pass and no temporary the size of the audio: for 30 s,
    21 us against 30 us for np.isfinite(audio).all() (a bool per sample written, then read back) and 120 us for a
    float64 sum, on one core (bench/engine_ipc.py).

    Exact: a sum is finite only if every term is. A NaN term makes every partial sum it enters NaN, an infinite one
    makes it infinite or NaN (inf - inf), and neither becomes finite again, in whatever order the additions run. The
    converse fails only when finite samples overflow the float32 sum (past 3.4e38: not audio in [-1, 1]), so a sum
    that is not finite is decided sample by sample."""
    if audio.ndim == 1 and audio.dtype.kind == "f" and np.isfinite(np.einsum("i->", audio)):
        return True
    return bool(np.isfinite(audio).all())


def copy_samples(tails: list[np.ndarray], out: np.ndarray) -> list[bool]:
    """The 1-D arrays `tails` one after the other into `out` (float32 audio, or a cast to it) -> whether each tail's
    samples are all finite, checked on its copy just written (still in cache, where it fits)."""
    ends = np.cumsum([tail.size for tail in tails], dtype=np.int64)
    if (ends[-1] if tails else 0) != out.size:
        raise ValueError(f"{out.size} samples of room for {ends[-1] if tails else 0} samples")
    finite = [True] * len(tails)

    def copy_run(first: int, last: int) -> None:
        for i in range(first, last):
            copy = out[ends[i] - tails[i].size : ends[i]]
            with np.errstate(over="ignore"):  # a float64 sample past float32's range: infinite, refused below
                np.copyto(copy, tails[i], casting="same_kind")
            finite[i] = all_finite(copy)

    if out.size < PARALLEL_COPY_SAMPLES or len(tails) < 2:
        copy_run(0, len(tails))
        return finite
    # COPY_THREADS runs of whole tails, about equal in samples
    cuts = [0, *np.searchsorted(ends, [out.size * k // COPY_THREADS for k in range(1, COPY_THREADS)], side="right"),
            len(tails)]
    for done in [_copy_threads().submit(copy_run, a, b) for a, b in zip(cuts, cuts[1:]) if a < b]:
        done.result()  # re-raises a copy's error here
    return finite
