"""engine/host_copy.py: an admission's audio tails into one (pinned) host buffer, by several threads past a size, the
same samples in the same order as one np.concatenate, each tail checked finite; the check itself (`all_finite`), exact
wherever the bad sample is and whatever the dtype, including finite audio whose sum overflows."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from qasr.engine import host_copy
from qasr.engine.host_copy import all_finite


@pytest.mark.parametrize("parallel_from", [1, 10**9])  # every copy on the threads; none
def test_copy_equals_one_concatenate(monkeypatch, parallel_from):
    monkeypatch.setattr(host_copy, "PARALLEL_COPY_SAMPLES", parallel_from)
    rng = np.random.default_rng(0)
    sizes = [5, 0, 1234, 7, 40_000, 3, 0, 999, 16_000]  # uneven runs for the threads, empty tails among them
    tails = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    tails[3] = tails[3].astype(np.float64)  # cast as np.concatenate(..., casting="same_kind") does
    out = np.full(sum(sizes), np.nan, dtype=np.float32)
    assert host_copy.copy_samples(tails, out) == [True] * len(sizes)
    assert np.array_equal(out, np.concatenate(tails).astype(np.float32))


@pytest.mark.parametrize("parallel_from", [1, 10**9])
def test_each_tail_is_checked_finite_as_it_is_copied(monkeypatch, parallel_from):
    monkeypatch.setattr(host_copy, "PARALLEL_COPY_SAMPLES", parallel_from)
    tails = [np.ones(n, np.float32) for n in (100, 5, 3_000, 0, 64, 2_000)]
    tails[1][4] = np.nan
    tails[4][0] = -np.inf
    tails.append(np.array([1e300, 0.0]))  # finite as float64, infinite as the float32 it is copied to
    out = np.empty(sum(tail.size for tail in tails), np.float32)
    assert host_copy.copy_samples(tails, out) == [True, False, True, True, False, True, False]
    assert np.array_equal(out[:100], np.ones(100, np.float32))  # the copies are made all the same


def test_a_buffer_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="room"):
        host_copy.copy_samples([np.zeros(10, np.float32)], np.empty(11, np.float32))


def test_an_uncastable_tail_raises_from_the_threads(monkeypatch):
    monkeypatch.setattr(host_copy, "PARALLEL_COPY_SAMPLES", 1)
    tails = [np.zeros(10, np.float32), np.zeros(10, np.complex64)]  # complex to float32: not a same-kind cast
    with pytest.raises(TypeError):
        host_copy.copy_samples(tails, np.empty(20, np.float32))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_copies_on_threads_of_its_own(monkeypatch):
    monkeypatch.setattr(host_copy, "PARALLEL_COPY_SAMPLES", 1)
    tails = [np.arange(n, dtype=np.float32) for n in (3, 4, 5)]
    # the parent's copy threads all started (each holds the barrier until all four are running), then idle: a
    # pool forked as it is would hand the child's work to those threads, which the child does not have
    barrier = threading.Barrier(host_copy.COPY_THREADS + 1)
    waits = [host_copy._copy_threads().submit(barrier.wait) for _ in range(host_copy.COPY_THREADS)]
    barrier.wait()
    for wait in waits:
        wait.result()
    time.sleep(0.2)
    pid = os.fork()
    if pid == 0:  # the child: its copy must not wait for threads that were not forked with it
        out = np.empty(12, np.float32)
        host_copy.copy_samples(tails, out)
        os._exit(0 if np.array_equal(out, np.concatenate(tails)) else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's copy hung")


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
