"""bench/engine_ipc.py runs end to end: both framings over the pipe and the socket, every audio length, the JSON."""

import json
import subprocess
import sys


def test_the_ipc_bench_measures_both_framings_on_both_transports(tmp_path):
    subprocess.run([sys.executable, "-m", "qasr.bench.engine_ipc", "--seconds", "0.5", "3", "--requests", "5",
                    "--out", str(tmp_path)], check=True, timeout=120, capture_output=True)
    report = json.loads((tmp_path / "engine_ipc.json").read_text())
    assert set(report["ipc"]) == {"pipe/before", "pipe/now", "socket/before", "socket/now"}
    for rows in report["ipc"].values():
        assert set(rows) == {"0.5", "3"}
        for row in rows.values():
            assert row["receive_cpu_us"] > 0 and row["send_cpu_us"] > 0 and row["round_trip_us"] > 0
    assert report["finite_check"]["seconds"] == 3 and report["finite_check"]["now_cpu_us"] > 0
