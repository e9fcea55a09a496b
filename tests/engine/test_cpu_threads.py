"""The engine process's torch threads on the CPU: every usable core but one, which the front end keeps (its event
loop, its workers); torch's own default on a GPU and wherever OMP_NUM_THREADS says how many."""

from __future__ import annotations

import pytest

from qasr.engine.engine_process import cpu_threads


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (16, 15)])
def test_a_cpu_engine_leaves_one_core_to_the_front_end(monkeypatch, cores, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads("cpu", cores=cores) == threads


def test_a_gpu_engine_and_an_explicit_omp_num_threads_keep_torchs_choice(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads("cuda", cores=16) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert cpu_threads("cpu", cores=16) is None


def test_the_usable_cores_are_this_process_affinity(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    assert cpu_threads("cpu") == 2
