"""`python -m qasr.bench.frontend_server`: the server on the fake engine, in a process of its own, carries a short
`qasr-bench stream` run in each wire format, whose CPU is measured from its pid."""

from __future__ import annotations

import pytest

from qasr.bench import stream as stream_bench
from qasr.bench.frontend_server import spoken_words


@pytest.mark.parametrize("protocol, extra, audio_format", [
    ("native", [], "16000 Hz s16le"),
    ("native", ["--sample-rate", "24000"], "24000 Hz s16le"),  # what an OpenAI client sends
    ("native", ["--sample-rate", "8000", "--encoding", "mulaw", "--chunk-ms", "20"], "8000 Hz mulaw"),  # a call's
    ("openai", [], "24000 Hz s16le"),
    ("deepgram", [], "24000 Hz s16le"),
    ("twilio", [], "8000 Hz mulaw"),
    ("twilio", ["--tracks", "both"], "8000 Hz mulaw"),
])
def test_the_front_end_server_carries_a_stream_bench_run_in_each_protocol(frontend_server, protocol, extra,
                                                                          audio_format):
    pid, port = frontend_server
    result = stream_bench.main(["--protocol", protocol, *extra, "--url", f"ws://127.0.0.1:{port}", "--clients", "2",
                                "--duration", "3", "--speed", "2", "--stagger-s", "0.2", "--partial-interval-ms",
                                "300", "--drain-timeout-s", "20", "--server-pid", str(pid), "--sample-interval-s",
                                "0.25", "--no-progress"])
    tracks = 2 if "both" in extra else 1
    assert result["config"]["protocol"] == protocol and result["config"]["tracks"] == tracks
    assert result["config"]["audio_format"] == audio_format
    totals = result["totals"]
    assert totals["failed_clients"] == 0 and totals["missing_finals"] == totals["extra_finals"] == 0
    for session in result["sessions"]:
        assert session["close_code"] == 1000 and session["drained"] and not session["error"]
        assert session["finals"] == session["segments"] >= tracks  # 6 s of audio holds speech on every track
        assert session["audio_seconds"] == pytest.approx(6, abs=0.2)
        assert session["partials"] > 0  # partials or, for openai, deltas: the fake engine's words grow
    summary = result["summary"]
    assert summary["end_to_final_ms"]["n"] == totals["finals"]
    assert summary["final_latency_ms"]["n"] == (0 if protocol == "deepgram" else totals["finals"])  # no endpoint time
    assert summary["first_partial_latency_ms"]["n"] > 0 and summary["send_lag_ms"]["n"] > 0
    assert summary["partial_latency_ms"]["n"] == (0 if protocol == "openai" else totals["partials"])  # no audio end
    cpu = result["server_cpu"]
    assert cpu["source"] == f"/proc/{pid}/stat and its descendants" and cpu["cpu_seconds"] > 0
    assert cpu["cpu_ms_per_audio_second"] == pytest.approx(1e3 * cpu["cpu_seconds"] / totals["audio_seconds"])
    assert cpu["percent_of_one_core_per_stream"] == pytest.approx(cpu["mean_percent_of_one_core"] / 2)


def test_the_fake_engines_words_grow_with_the_audio():
    one, two = spoken_words(16000), spoken_words(32000)
    assert two.startswith(one) and len(two.split()) == 5 and len(one.split()) in (2, 3)
    assert spoken_words(0) == "the"
