"""Fixtures shared by the bench tests."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def frontend_server():
    """The server on the fake engine (bench/frontend_server.py) in a process of its own: real sockets, sessions and
    VAD, no model -> (its pid, its port)."""
    process = subprocess.Popen([sys.executable, "-m", "qasr.bench.frontend_server", "--port", "0", "--delay-ms", "5"],
                               stdout=subprocess.PIPE, text=True)
    try:
        ready = process.stdout.readline().split()  # "ready PID PORT", or nothing if it died
        assert ready[:1] == ["ready"], f"the front-end server did not start (exit code {process.poll()})"
        yield int(ready[1]), int(ready[2])
    finally:
        process.terminate()
        process.wait(timeout=30)
