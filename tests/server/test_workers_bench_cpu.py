"""qasr-bench stream --server-pid: the server's CPU is its whole process tree (with --workers: the supervisor, its
workers and its engine processes), however deep, not the process it was given alone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qasr.bench.stream import process_cpu_seconds

BURN_S = 0.6  # CPU seconds the grandchild spends before it says so


def test_server_cpu_counts_a_grandchild_started_from_a_thread_that_ended(tmp_path):
    done = tmp_path / "burnt"
    grandchild = (f"import time, pathlib\nstart = time.process_time()\nwhile time.process_time() - start < {BURN_S}:\n"
                  f"    pass\npathlib.Path({str(done)!r}).touch()\ntime.sleep(60)\n")
    # the supervisor starts its engine processes from loading threads that end: so does this parent
    parent_code = ("import subprocess, sys, threading, time\n"
                   f"thread = threading.Thread(target=subprocess.Popen, args=([sys.executable, '-c', {grandchild!r}],))\n"
                   "thread.start(); thread.join(); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    try:
        deadline = time.monotonic() + 60
        while not done.exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the grandchild did not burn its CPU"
            time.sleep(0.1)
        own = process_cpu_seconds_of_one(parent.pid)
        assert own < BURN_S / 2  # the parent itself only waits
        assert process_cpu_seconds(parent.pid) >= own + BURN_S
    finally:
        children = [int(pid) for pid in Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()]
        parent.kill()
        parent.wait()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_process_that_is_gone_is_an_error():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    with pytest.raises(FileNotFoundError):
        process_cpu_seconds(process.pid)


def process_cpu_seconds_of_one(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
