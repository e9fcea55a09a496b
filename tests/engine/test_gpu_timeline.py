"""The engine's profiler window (engine/gpu_timeline.py): the summary's arithmetic (busy time as a union per stream
and in all, overlap, top kernels), the trigger file that opens a window, and the window in a real engine process on
the CPU (its operators stand in for kernels; the GPU run of the stream bench reads the CUDA streams)."""

import asyncio
import json

import pytest

from qasr.engine.engine_process import EngineProcess
from qasr.engine.gpu_timeline import (PROFILE_ENV, PROFILE_SECONDS_ENV, EngineProfiler, Kernel, busy_us, idle_gaps,
                                      summarize)
from qasr.engine.request import DecodeRequest

from test_engine import make_engine, speech
from test_engine_process import OPTIONS


def test_busy_time_is_the_union_of_the_intervals():
    def spans(*intervals):
        return [Kernel(0, "k", start, end - start) for start, end in intervals]

    assert busy_us([]) == 0
    assert busy_us(spans((0, 10), (5, 15), (20, 30))) == 25  # an overlap counted once, a gap not at all
    assert busy_us(spans((0, 100), (10, 20), (30, 40))) == 100  # nested


def test_the_summary_splits_busy_time_by_stream_and_counts_what_ran_on_two_at_once():
    kernels = [Kernel(7, "gemv", 0, 400), Kernel(7, "gemv", 500, 400), Kernel(7, "attention", 900, 100),
               Kernel(13, "encoder", 300, 800)]
    summary = summarize(kernels, window_s=0.002)
    decode, admission = summary["streams"]["7"], summary["streams"]["13"]
    assert list(summary["streams"]) == ["7", "13"]  # the busiest first
    assert decode["kernels"] == 3 and decode["busy_ms"] == pytest.approx(0.9) and decode["busy_fraction"] == 0.45
    assert decode["top_kernels"][0] == {"name": "gemv", "count": 2, "ms": 0.8}
    assert admission["busy_ms"] == pytest.approx(0.8)
    assert summary["gpu_busy_fraction"] == pytest.approx(1.1 / 2)  # 0-1.1 ms: something ran
    assert summary["streams_overlap_ms"] == pytest.approx(0.6)  # 0.3-0.4 and 0.5-1.0 ms: both streams


def test_the_idle_stretches_are_sorted_by_length_and_the_longest_named():
    # on two streams: 0-50 and 40-100 overlap, then 5 us idle, 105-200, 2 ms idle, 2200-2300, 30 us idle, 2330-2400
    kernels = [Kernel(7, "a", 0, 50), Kernel(13, "b", 40, 60), Kernel(7, "c", 105, 95), Kernel(13, "d", 2200, 100),
               Kernel(7, "e", 2330, 70)]
    assert idle_gaps(kernels) == [(100, 5), (200, 2000), (2300, 30)]
    assert idle_gaps([]) == [] and idle_gaps(kernels[:1]) == []
    idle = summarize(kernels, window_s=0.003)["idle"]
    assert idle["between_kernels_ms"] == pytest.approx(2.035)
    assert idle["by_length"]["0-10 us"] == {"count": 1, "ms": pytest.approx(0.005)}
    assert idle["by_length"]["10-100 us"] == {"count": 1, "ms": pytest.approx(0.03)}
    assert idle["by_length"]["1000-10000 us"] == {"count": 1, "ms": pytest.approx(2.0)}
    assert idle["by_length"]["100-1000 us"]["count"] == idle["by_length"][">= 10000 us"]["count"] == 0
    assert idle["longest"][0] == {"at_ms": pytest.approx(0.2), "ms": pytest.approx(2.0)}
    assert [gap["ms"] for gap in idle["longest"]] == pytest.approx([2.0, 0.03, 0.005])
    assert idle["outside_kernels_ms"] == pytest.approx(0.6)  # a 3 ms window, kernels over 2.4 of it
    # busy + idle between kernels + outside them = the window
    busy_ms = summarize(kernels, window_s=0.003)["gpu_busy_fraction"] * 3
    assert busy_ms + idle["between_kernels_ms"] + idle["outside_kernels_ms"] == pytest.approx(3.0)


def test_a_window_opens_for_each_new_label_and_writes_its_summary(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir)
    profiler = EngineProfiler(tmp_path, seconds=0.2, device_type="cpu", poll_s=0)

    def decode_a_while():
        engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=40), lambda r: None)
        while engine.has_work():
            engine.step()
            profiler.after_step()
        profiler.close()

    decode_a_while()
    assert not list(tmp_path.glob("engine-*.json"))  # not asked
    (tmp_path / "start").write_text("600-r1\n")
    decode_a_while()
    (written,) = tmp_path.glob("engine-*-600-r1.json")
    summary = json.loads(written.read_text())
    assert summary["label"] == "600-r1" and summary["kernels"] > 0 and 0 < summary["gpu_busy_fraction"] <= 1
    assert summary["window_s"] > 0 and summary["streams"]
    written.unlink()
    decode_a_while()
    assert not list(tmp_path.glob("engine-*.json"))  # the same label: no second window
    (tmp_path / "start").write_text("1000/r2")  # a label is a file name's part: no path in it
    decode_a_while()
    assert [p.name.split("-", 2)[2] for p in tmp_path.glob("engine-*.json")] == ["1000_r2.json"]


def test_a_profiler_that_cannot_start_is_disarmed_not_raised(tmp_path, monkeypatch):
    profiler = EngineProfiler(tmp_path, seconds=1, device_type="cpu", poll_s=0)
    (tmp_path / "start").write_text("x")

    def broken(label):
        raise RuntimeError("CUPTI unavailable")

    monkeypatch.setattr(profiler, "_open", broken)
    profiler.after_step()  # logged, not raised: the engine loop goes on
    monkeypatch.undo()
    (tmp_path / "start").write_text("y")
    profiler.after_step()
    assert profiler._prof is None  # disarmed: no window opens again


def test_the_environment_arms_it(monkeypatch, tmp_path):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert EngineProfiler.from_env("cpu") is None  # off by default
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv(PROFILE_SECONDS_ENV, "3")
    profiler = EngineProfiler.from_env("cuda")
    assert profiler.seconds == 3 and (tmp_path / "profiles").is_dir()
    monkeypatch.setenv(PROFILE_SECONDS_ENV, "0")
    with pytest.raises(ValueError, match=PROFILE_SECONDS_ENV):
        EngineProfiler.from_env("cpu")


def test_an_engine_process_profiles_when_asked(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path))  # the spawned engine process inherits it
    monkeypatch.setenv(PROFILE_SECONDS_ENV, "30")  # longer than the test: the window is closed at the process's exit
    (tmp_path / "start").write_text("e2e")

    async def main():
        engine = EngineProcess(str(tiny_model_dir), device="cpu", dtype="float32", options=OPTIONS)
        await engine.start()
        try:
            result = await engine.transcribe(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=6))
            assert len(result.token_ids) == 6
        finally:
            await engine.close()

    asyncio.run(main())
    (written,) = tmp_path.glob("engine-*-e2e.json")
    assert json.loads(written.read_text())["kernels"] > 0
