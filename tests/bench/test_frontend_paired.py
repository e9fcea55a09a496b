"""bench/frontend_paired.py: every protocol on its own front-end server at once, rotated over the servers, and each
protocol's CPU per audio second as a ratio to the first protocol's within each round."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qasr.bench import frontend_paired
from qasr.bench.frontend_paired import Entry


def test_entries_read_as_frontend_protocols_sh_writes_them():
    assert (Entry("openai").protocol, Entry("openai").options, Entry("openai").name) == ("openai", [], "openai")
    native = Entry("native:8000-mulaw@20")
    assert native.protocol == "native" and native.name == "native-8000-mulaw-c20"
    assert native.options == ["--sample-rate", "8000", "--encoding", "mulaw", "--chunk-ms", "20"]
    assert Entry("native:24000").options == ["--sample-rate", "24000"]
    assert Entry("deepgram@50").options == ["--chunk-ms", "50"] and Entry("deepgram@50").protocol == "deepgram"


def run(cpu_ms: float, failed: int = 0, missing: int = 0) -> dict:
    return {"server_cpu": {"cpu_ms_per_audio_second": cpu_ms},
            "totals": {"failed_clients": failed, "missing_finals": missing, "extra_finals": 0}}


def test_ratios_are_taken_within_each_round_then_their_median_and_range():
    entries = [Entry("native:24000"), Entry("openai")]
    rounds = [{"native:24000": run(2.0), "openai": run(2.2)},  # 1.10
              {"native:24000": run(4.0), "openai": run(4.2, failed=1)},  # 1.05: a slower round, the same ratio band
              {"native:24000": run(3.0), "openai": run(3.0, missing=2)}]  # 1.00
    native, openai = frontend_paired.table(entries, rounds)
    assert native["ratio"] == [1.0, 1.0, 1.0] and native["ratio_median"] == 1.0
    assert openai["ratio"] == pytest.approx([1.1, 1.05, 1.0]) and openai["ratio_median"] == pytest.approx(1.05)
    assert openai["failed_clients"] == 1 and openai["missing_or_extra_finals"] == 2
    text = frontend_paired.markdown([native, openai], 30)
    assert "| openai | 2.20, 4.20, 3.00 | 1.050x (1.000-1.100) | 1 | 2 |" in text


def test_a_run_without_the_servers_cpu_is_refused():
    with pytest.raises(ValueError, match="server-pid"):
        frontend_paired.table([Entry("native")], [{"native": {"server_cpu": None, "totals": {}}}])
    with pytest.raises(ValueError, match="10 ms ticks"):  # measured, but none: no ratio can be taken against it
        frontend_paired.table([Entry("native")], [{"native": {"server_cpu": {"cpu_ms_per_audio_second": 0.0},
                                                              "totals": {}}}])


def test_a_short_paired_run_rotates_every_protocol_over_every_server(tmp_path):
    # 4 streams for 2 s in real time: enough CPU for /proc's 10 ms ticks to count on a busy machine (1 stream at 2x
    # speed for 1 s measured none once in CI)
    done = subprocess.run(
        [sys.executable, "-m", "qasr.bench.frontend_paired", str(tmp_path), "native:24000", "deepgram",
         "--streams", "4", "--duration", "2", "--stagger-s", "0",
         "--bench-arg=--drain-timeout-s", "--bench-arg=20"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in tmp_path.glob("*.json")) == [
        "deepgram-4-r1.json", "deepgram-4-r2.json", "native-24000-4-r1.json", "native-24000-4-r2.json"]
    lines = done.stdout.splitlines()
    assert lines[2].startswith("| native:24000 | ") and "| 1.000x (1.000-1.000) | 0 | 0 |" in lines[2]
    assert lines[3].startswith("| deepgram | ") and lines[3].endswith("| 0 | 0 |")
    assert (tmp_path / "paired.md").read_text().strip() == done.stdout.strip()
