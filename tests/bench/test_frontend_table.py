"""bench/frontend_protocols.sh and its table (qasr.bench.frontend_table): the front end's cost per protocol."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qasr.bench import frontend_table

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "frontend_protocols.sh"


def run_result(protocol: str, clients: int, cpu_ms: float | None, *, tracks: int = 1, failed: int = 0,
               final_p50: float = 20.0, chunk_ms: int = 100, audio_format: str | None = None) -> dict:
    """The parts of a `qasr-bench stream --out` file the table reads (`audio_format` None: a file from before the
    config recorded it)."""
    cpu = None if cpu_ms is None else {"cpu_ms_per_audio_second": cpu_ms, "percent_of_one_core_per_stream": cpu_ms / 10}
    return {"config": {"protocol": protocol, "tracks": tracks, "clients": clients, "duration_s": 20.0, "speed": 1.0,
                       "chunk_ms": chunk_ms, **({"audio_format": audio_format} if audio_format else {})},
            "totals": {"failed_clients": failed, "finals": 10, "missing_finals": 1, "extra_finals": 0},
            "summary": {"final_latency_ms": {"n": 10, "p50": final_p50, "p95": 2 * final_p50},
                        "send_lag_ms": {"n": 100, "p99": 3.0}},
            "server_cpu": cpu}


def test_rows_give_the_median_and_spread_of_each_protocol_and_its_ratio_to_native_at_the_same_load():
    runs = [run_result("native", 20, 10.0), run_result("native", 20, 12.0), run_result("native", 20, 11.0),
            run_result("openai", 20, 11.0, final_p50=30.0), run_result("openai", 20, 13.2, failed=1),
            run_result("twilio", 20, 22.0, tracks=2, chunk_ms=20), run_result("native", 20, 16.5, chunk_ms=20),
            run_result("native", 40, 9.0), run_result("twilio", 40, None)]
    rows = {(row["protocol"], row["streams"]): row for row in frontend_table.rows(runs)}
    assert list(rows) == [("native, 100 ms", 20), ("native, 20 ms", 20), ("openai, 100 ms", 20),
                          ("twilio (2 tracks), 20 ms", 20), ("native, 100 ms", 40), ("twilio, 100 ms", 40)]
    native = rows["native, 100 ms", 20]
    assert native["runs"] == 3 and native["cpu_ms_per_audio_s"] == 11.0
    assert native["cpu_ms_per_audio_s_range"] == (10, 12)
    assert native["vs_native"] == 1.0 and native["missing_or_extra_finals"] == 3
    assert rows["native, 20 ms", 20]["vs_native"] == 1.5  # against native at 100 ms per message
    openai = rows["openai, 100 ms", 20]
    assert openai["cpu_ms_per_audio_s"] == pytest.approx(12.1) and openai["vs_native"] == pytest.approx(12.1 / 11)
    assert openai["failed_clients"] == 1 and openai["final_p50_ms"] == 25.0 and openai["final_p95_ms"] == 50.0
    assert rows["twilio (2 tracks), 20 ms", 20]["vs_native"] == 2.0
    unmeasured = rows["twilio, 100 ms", 40]
    assert unmeasured["cpu_ms_per_audio_s"] is None and unmeasured["vs_native"] is None
    text = frontend_table.markdown(frontend_table.rows(runs))
    assert "| openai, 100 ms | 20 | 2 | 12.1 (11.0-13.2) | 1.21 | 1.10x | - | 25.0 / 50.0 |" in text
    assert len(text.splitlines()) == 2 + 6


def test_an_adapter_is_also_compared_with_native_sending_the_same_audio_in_the_same_messages():
    runs = [run_result("native", 20, 10.0),
            run_result("native", 20, 11.0, audio_format="24000 Hz s16le"),
            run_result("openai", 20, 12.1, audio_format="24000 Hz s16le"),
            run_result("native", 20, 20.0, chunk_ms=20, audio_format="8000 Hz mulaw"),
            run_result("native", 20, 30.0, chunk_ms=100, audio_format="8000 Hz mulaw"),
            run_result("twilio", 20, 22.0, chunk_ms=20),  # a file without audio_format: Twilio's is 8 kHz mulaw
            run_result("twilio", 20, 50.0, chunk_ms=20, tracks=2)]
    rows = {row["protocol"]: row for row in frontend_table.rows(runs)}
    assert list(rows) == ["native, 100 ms", "native 24 kHz, 100 ms", "native 8 kHz mulaw, 100 ms",
                          "native 8 kHz mulaw, 20 ms", "openai, 100 ms", "twilio (2 tracks), 20 ms", "twilio, 20 ms"]
    assert rows["openai, 100 ms"]["vs_native"] == pytest.approx(1.21)  # against 16 kHz at 100 ms
    assert rows["openai, 100 ms"]["vs_native_same_audio"] == pytest.approx(1.1)  # against 24 kHz at 100 ms
    assert rows["twilio, 20 ms"]["vs_native_same_audio"] == pytest.approx(1.1)  # 8 kHz mulaw at 20 ms, not 100
    assert rows["twilio (2 tracks), 20 ms"]["vs_native_same_audio"] is None  # twice the frames: no like for like
    assert rows["native 24 kHz, 100 ms"]["vs_native"] == pytest.approx(1.1)
    assert rows["native 24 kHz, 100 ms"]["vs_native_same_audio"] is None  # itself
    assert "| twilio, 20 ms | 20 | 1 | 22.0 (22.0-22.0) | 2.20 | 2.20x | 1.10x |" in frontend_table.markdown(
        frontend_table.rows(runs))


def test_a_folder_without_results_is_refused(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"not": "a result"}))
    with pytest.raises(SystemExit) as refused:
        frontend_table.main([str(tmp_path)])
    assert refused.value.code == 2


def test_the_script_runs_every_protocol_against_the_front_end_server_and_prints_the_table(tmp_path):
    env = {**os.environ, "STREAMS": "1", "DURATION": "2", "REPEATS": "1", "STAGGER_S": "0", "SETTLE_S": "0",
           "PROTOCOLS": "native openai twilio:both@20 native:8000-mulaw@20", "BENCH_ARGS": "--speed 2 --drain-timeout-s 20",
           "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in tmp_path.glob("*.json")) == [
        "native-1-1.json", "native-8000-mulaw-c20-1-1.json", "openai-1-1.json", "twilio-both-c20-1-1.json"]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()[2:]]
    assert [row[0].strip() for row in rows] == ["native, 100 ms", "native 8 kHz mulaw, 20 ms", "openai, 100 ms",
                                                "twilio (2 tracks), 20 ms"]
    for row in rows:
        assert row[9].strip() == "0"  # failed clients
    assert (tmp_path / "table.md").read_text().strip() == done.stdout.strip()
