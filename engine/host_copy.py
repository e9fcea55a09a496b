"""Audio samples into one host buffer, on several threads when there are many (numpy lets go of the GIL while it
copies): an admission stages all its clips' samples in pinned memory for one copy to the device, and on one thread
that copy held 12% of the engine thread in an offline run of 512 rows (py-spy on the H200, session 21)."""

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


def copy_samples(tails: list[np.ndarray], out: np.ndarray) -> None:
    """The 1-D arrays `tails` one after the other into `out` (float32 audio, or a cast to it)."""
    if out.size < PARALLEL_COPY_SAMPLES or len(tails) < 2:
        np.concatenate(tails, out=out, casting="same_kind")
        return
    ends = np.cumsum([tail.size for tail in tails])
    # COPY_THREADS runs of whole tails, about equal in samples
    cuts = [0, *np.searchsorted(ends, [out.size * k // COPY_THREADS for k in range(1, COPY_THREADS)], side="right"),
            len(tails)]

    def copy_run(first: int, last: int) -> None:
        for i in range(first, last):
            start = ends[i] - tails[i].size
            np.copyto(out[start : ends[i]], tails[i], casting="same_kind")

    for done in [_copy_threads().submit(copy_run, a, b) for a, b in zip(cuts, cuts[1:]) if a < b]:
        done.result()  # re-raises a copy's error here
