"""`qasr-bench stream` briefly against an in-process server (tiny random model, CPU) on a thread of its own."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import numpy as np
import pytest

from qasr.bench import stream as stream_bench
from qasr.bench.protocol_clients import ClientRecord
from qasr.server.app import QasrServer, ServerConfig
from qasr.engine.engine import AsyncEngine, EngineOptions
from qasr.streaming.settings import StreamLimits

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine
from live_server import ThreadedServer

SR = 16000


@pytest.fixture
def server_url(tiny_model_dir):
    """ws:// URL of a server with the tiny model, running on its own event loop in a thread (the bench runs its own)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> QasrServer:
        options = EngineOptions(num_slots=8, max_len=1024, num_retained=8, tokens_per_second=4.0)
        engine = AsyncEngine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32", options=options)
        await engine.start()
        server = QasrServer(engine, ServerConfig(port=0, ping_interval_s=None))
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
    try:
        yield f"ws://127.0.0.1:{server.port}/v1/stream"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_a_short_run_reports_every_metric_with_sane_values(server_url, tmp_path):
    out_path, plot_path = tmp_path / "stream.json", tmp_path / "stream.png"
    argv = ["--url", server_url, "--clients", "3", "--duration", "4", "--speed", "1.5", "--stagger-s", "0.3",
            "--partial-interval-ms", "300", "--drain-timeout-s", "30", "--server-pid", str(os.getpid()),
            "--sample-interval-s", "0.25", "--out", str(out_path), "--no-progress"]
    has_matplotlib = True
    try:
        import matplotlib  # noqa: F401  (an optional bench dependency)
    except ImportError:
        has_matplotlib = False
    result = stream_bench.main(argv + (["--plot", str(plot_path)] if has_matplotlib else []))

    assert json.loads(out_path.read_text()) == json.loads(json.dumps(result))  # what it wrote is what it returned
    sessions = result["sessions"]
    assert len(sessions) == 3 and len({session["session_id"] for session in sessions}) == 3
    for session in sessions:
        assert session["close_code"] == 1000 and session["drained"] and not session["error"]
        assert session["finals"] == session["segments"] >= 1
        assert session["audio_seconds"] == pytest.approx(4 * 1.5, abs=0.3)
    totals = result["totals"]
    assert totals["failed_clients"] == 0 and totals["finals"] == sum(session["finals"] for session in sessions)
    assert totals["partials"] > 0  # 300 ms partials at 1.5x real time on an idle tiny model
    summary = result["summary"]
    assert set(summary) == set(stream_bench.METRICS)
    for key in ("first_partial_latency_ms", "partial_latency_ms", "final_latency_ms", "end_to_final_ms",
                "send_lag_ms"):
        stats = summary[key]
        assert stats["n"] > 0, key
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p95"] <= stats["p99"] <= stats["max"] < 30_000, key
    assert summary["final_latency_ms"]["n"] == totals["finals"]
    assert sum(row["n"] for row in result["by_segment_length"]) == totals["finals"]  # every final in one length bin
    assert summary["send_lag_ms"]["n"] >= 3 * 4 * 1.5 * 10 - 3  # one per 100 ms chunk
    cpu = result["server_cpu"]
    assert cpu["source"] == f"/proc/{os.getpid()}/stat and its descendants" and cpu["cpu_seconds"] > 0
    assert 0 < cpu["mean_percent_of_one_core"] <= 100 * os.cpu_count() + 50
    if has_matplotlib:
        assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_clients_spread_over_processes_are_all_reported(server_url, tmp_path):
    argv = ["--url", server_url, "--clients", "4", "--processes", "2", "--duration", "3", "--speed", "1.5",
            "--stagger-s", "0.2", "--partial-interval-ms", "300", "--drain-timeout-s", "30", "--no-progress"]
    result = stream_bench.main(argv)
    sessions = result["sessions"]
    assert [session["client"] for session in sessions] == [0, 1, 2, 3]
    assert len({session["session_id"] for session in sessions}) == 4
    for session in sessions:
        assert session["drained"] and not session["error"] and session["finals"] == session["segments"] >= 1
    assert result["totals"]["failed_clients"] == 0
    assert result["summary"]["final_latency_ms"]["n"] == result["totals"]["finals"]
    # every client process's send lags are merged (how many a client gets depends on the host keeping pace: under
    # load its processes start late and send fewer chunks before the run ends, so no count is asserted)
    lags = [session["metrics"]["send_lag_ms"]["n"] for session in sessions]
    assert all(n > 0 for n in lags) and result["summary"]["send_lag_ms"]["n"] == sum(lags)


def test_words_ask_every_native_stream_for_word_times_and_count_the_finals_that_carried_them():
    """--words against a server that can time words (the fake engine spreads them) and one that cannot (refused)."""
    argv = ["--clients", "2", "--duration", "3", "--speed", "2", "--stagger-s", "0.2", "--partial-interval-ms",
            "300", "--drain-timeout-s", "20", "--no-progress", "--words"]
    with ThreadedServer(lambda: FakeEngine(delay_s=0.005), stream_limits=StreamLimits(word_times=True)) as server:
        result = stream_bench.main(["--url", server.url, *argv])
    totals = result["totals"]
    assert result["config"]["words"] is True and totals["failed_clients"] == 0
    assert totals["finals"] >= 2 and totals["finals_with_words"] == totals["finals"]
    assert all(session["finals_with_words"] == session["finals"] for session in result["sessions"])

    with ThreadedServer(lambda: FakeEngine(delay_s=0.005)) as server:  # no aligner: every stream is turned away
        refused = stream_bench.main(["--url", server.url, *argv])
    assert refused["totals"]["failed_clients"] == 2
    assert all("unsupported" in session["error"] for session in refused["sessions"])


class SlowWordsEngine(FakeEngine):
    """The fake engine, with every final that asked for word times held WORDS_DELAY_S longer (a busy aligner)."""

    WORDS_DELAY_S = 0.3

    async def transcribe(self, request):
        result = await super().transcribe(request)
        if request.words:
            await asyncio.sleep(self.WORDS_DELAY_S)
        return result


def test_words_fraction_spreads_the_clients_that_ask_evenly():
    assert [stream_bench.asks_for_words(i, 0.5) for i in range(6)] == [False, True] * 3
    assert [i for i in range(10) if stream_bench.asks_for_words(i, 0.3)] == [3, 6, 9]
    for fraction in (0.1, 0.25, 0.3, 0.5, 0.7, 0.9):  # the first n clients hold floor(n x fraction) that ask
        for n in (1, 7, 10, 100, 600):
            assert sum(stream_bench.asks_for_words(i, fraction) for i in range(n)) == int(n * fraction + 1e-9)
    assert all(stream_bench.asks_for_words(i, 1.0) for i in range(20))
    assert not any(stream_bench.asks_for_words(i, 0.0) for i in range(20))


def test_words_fraction_reports_final_latency_apart_for_streams_with_and_without_words():
    """Half the clients ask (1 and 3 of 4); the finals with words are held longer by the engine, and each group's
    latencies are exactly its own clients' finals."""
    argv = ["--clients", "4", "--duration", "3", "--speed", "2", "--stagger-s", "0.2", "--partial-interval-ms",
            "300", "--drain-timeout-s", "20", "--no-progress", "--words-fraction", "0.5"]
    with ThreadedServer(lambda: SlowWordsEngine(delay_s=0.005), stream_limits=StreamLimits(word_times=True)) as server:
        result = stream_bench.main(["--url", server.url, *argv])
    assert result["config"]["words"] is True and result["config"]["words_fraction"] == 0.5
    sessions = result["sessions"]
    assert result["totals"]["failed_clients"] == 0
    assert [session["words"] for session in sessions] == [False, True, False, True]
    for session in sessions:
        assert session["finals"] >= 1
        assert session["finals_with_words"] == (session["finals"] if session["words"] else 0)
    split = result["by_words"]
    for group, asked in (("with_words", True), ("without_words", False)):
        mine = [session for session in sessions if session["words"] is asked]
        assert split[group]["clients"] == 2
        assert split[group]["final_latency_ms"]["n"] == sum(session["finals"] for session in mine)
        assert split[group]["end_to_final_ms"]["n"] == sum(session["finals"] for session in mine)
    assert split["with_words"]["final_latency_ms"]["p50"] >= SlowWordsEngine.WORDS_DELAY_S * 1e3
    assert (split["with_words"]["final_latency_ms"]["n"] + split["without_words"]["final_latency_ms"]["n"]
            == result["summary"]["final_latency_ms"]["n"])


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit) as refused:
        stream_bench.main(["--clients", "0"])
    assert refused.value.code == 2
    with pytest.raises(SystemExit):
        stream_bench.main(["--server-pid", "999999999"])
    for argv in (["--sample-rate", "44100"], ["--encoding", "alaw"],
                 ["--protocol", "openai", "--sample-rate", "8000"], ["--protocol", "twilio", "--encoding", "mulaw"],
                 ["--protocol", "openai", "--words"], ["--protocol", "openai", "--words-fraction", "0.5"],
                 ["--words-fraction", "1.5"], ["--words-fraction", "-0.1"], ["--words", "--words-fraction", "0.5"]):
        with pytest.raises(SystemExit) as refused:  # native only, at the rates and encodings the adapters get
            stream_bench.main(argv)
        assert refused.value.code == 2, argv


def test_generated_audio_has_pauses_that_end_segments_and_each_client_its_own_audio():
    audio = stream_bench.utterances_with_pauses(20.0, seed=1)
    assert audio.dtype == np.float32 and len(audio) == 20 * SR
    frames = audio[: len(audio) // 160 * 160].reshape(-1, 160)
    quiet = np.sqrt((frames**2).mean(axis=1)) < 0.01
    longest_pause = max(len(run) for run in "".join("q" if q else "s" for q in quiet).split("s"))
    assert longest_pause * 10 >= 800  # ms: longer than the VAD's end silence
    assert not np.array_equal(stream_bench.client_audio(None, 5.0, 0), stream_bench.client_audio(None, 5.0, 1))
    source = np.arange(3 * SR, dtype=np.float32)  # a 3 s "file": clients start at their own offsets and loop it
    first, second = stream_bench.client_audio(source, 5.0, 0), stream_bench.client_audio(source, 5.0, 1)
    assert len(first) == len(second) == 5 * SR
    np.testing.assert_array_equal(first[: 3 * SR], source)
    np.testing.assert_array_equal(first[3 * SR :], source[: 2 * SR])
    assert second[0] == source[(7919 * SR // 1000) % len(source)]


def test_finals_are_counted_per_segment_of_each_channel():
    record = ClientRecord(0)
    record.events = [(0.0, {"type": "speech_started", "segment_id": 0, "start": 0.0, "channel": 0}),
                     (0.0, {"type": "speech_started", "segment_id": 0, "start": 0.0, "channel": 1}),
                     (0.0, {"type": "speech_started", "segment_id": 1, "start": 2.0, "channel": 0}),
                     (1.0, {"type": "final", "segment_id": 0, "end": 1.0, "latency_ms": 5.0, "channel": 0}),
                     (1.0, {"type": "final", "segment_id": 0, "end": 1.0, "latency_ms": 5.0, "channel": 1}),
                     (1.1, {"type": "final", "segment_id": 0, "end": 1.0, "latency_ms": 5.0, "channel": 1})]
    assert stream_bench.finals_per_segment(record) == (1, 1)  # channel 0's segment 1 has none; channel 1's two
    record.events.append((9.0, {"type": "final", "segment_id": 7, "end": 8.0, "latency_ms": 5.0, "channel": 0}))
    assert stream_bench.finals_per_segment(record) == (1, 2)  # a final of a segment that never started is extra


def test_metrics_a_protocol_does_not_report_are_left_out_not_guessed():
    record = ClientRecord(0, t0=100.0)
    record.events = [(100.5, {"type": "speech_started", "segment_id": 0, "start": 0.2}),
                     (101.0, {"type": "partial", "segment_id": 0, "text": "the "}),  # an OpenAI delta: no audio end
                     (101.5, {"type": "partial", "segment_id": 0, "text": "quick "}),
                     (102.0, {"type": "final", "segment_id": 0, "end": 1.5, "latency_ms": None})]
    metrics = stream_bench.client_metrics(record)
    assert metrics["partial_latency_ms"] == [] and metrics["final_latency_ms"] == []
    assert metrics["partial_gap_ms"] == pytest.approx([500.0])
    assert metrics["first_partial_latency_ms"] == pytest.approx([800.0])  # speech began at 0.2 s of the stream
    assert metrics["end_to_final_ms"] == pytest.approx([500.0])


def test_cpu_costs_per_second_of_audio_and_per_stream():
    cpu = {"cpu_seconds": 2.0, "mean_percent_of_one_core": 10.0}
    costs = stream_bench.cpu_costs(cpu, audio_seconds=400.0, clients=20)
    assert costs["cpu_ms_per_audio_second"] == 5.0 and costs["percent_of_one_core_per_stream"] == 0.5
    assert stream_bench.cpu_costs(None, 400.0, 20) is None
    assert stream_bench.cpu_costs(cpu, 0.0, 20)["cpu_ms_per_audio_second"] is None


def test_final_latency_is_also_given_by_segment_length():
    first, second = ClientRecord(0), ClientRecord(1)
    first.events = [(1.0, {"type": "final", "segment_id": 0, "start": 0.0, "end": 1.5, "latency_ms": 100.0}),
                    (5.0, {"type": "final", "segment_id": 1, "start": 2.0, "end": 7.0, "latency_ms": 300.0})]
    second.events = [(1.0, {"type": "final", "segment_id": 0, "start": 0.5, "end": 2.5, "latency_ms": 140.0}),  # 2 s
                     (9.0, {"type": "final", "segment_id": 1, "start": 3.0, "end": 12.0, "latency_ms": 500.0}),
                     (9.5, {"type": "final", "segment_id": 2, "start": 12.0, "end": 13.0, "latency_ms": None}),
                     (9.6, {"type": "partial", "segment_id": 3, "start": 13.0, "end": 14.0})]
    rows = stream_bench.by_segment_length([first, second])
    assert [(row["from_s"], row["to_s"], row["n"]) for row in rows] == [(0.0, 2.0, 1), (2.0, 4.0, 1), (4.0, 6.0, 1),
                                                                        (8.0, None, 1)]  # 6-8 s had none: left out
    assert [row["p50"] for row in rows] == [100.0, 140.0, 300.0, 500.0]
