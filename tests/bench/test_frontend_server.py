"""`python -m qasr.bench.frontend_server`: the server on the fake engine, in a process of its own, carries a short
`qasr-bench stream` run whose CPU is measured from its pid."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qasr.bench import stream as stream_bench


@pytest.fixture
def frontend_server():
    process = subprocess.Popen([sys.executable, "-m", "qasr.bench.frontend_server", "--port", "0", "--delay-ms", "5"],
                               stdout=subprocess.PIPE, text=True)
    try:
        ready = process.stdout.readline().split()  # "ready PID PORT", or nothing if it died
        assert ready[:1] == ["ready"], f"the front-end server did not start (exit code {process.poll()})"
        yield int(ready[1]), int(ready[2])
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_front_end_server_carries_a_stream_bench_run(frontend_server):
    pid, port = frontend_server
    result = stream_bench.main(["--url", f"ws://127.0.0.1:{port}/v1/stream", "--clients", "2", "--duration", "3",
                                "--speed", "2", "--stagger-s", "0.2", "--partial-interval-ms", "300",
                                "--drain-timeout-s", "20", "--server-pid", str(pid), "--sample-interval-s", "0.25",
                                "--no-progress"])
    assert result["totals"]["failed_clients"] == 0
    for session in result["sessions"]:
        assert session["close_code"] == 1000 and session["finals"] == session["segments"] >= 1
    assert result["server_cpu"]["source"] == f"/proc/{pid}/stat" and result["server_cpu"]["cpu_seconds"] > 0
