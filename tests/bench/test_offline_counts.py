"""The offline bench's arithmetic for energy per audio hour and kernels per decode step (the GPU parts that feed it,
NVML's counter and the profiler over graph replays, run only on the H200)."""

import gc
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from qasr.bench.offline import count_kernels, joules_per_audio_hour  # noqa: E402


def test_joules_per_audio_hour_scales_the_runs_energy_to_an_hour():
    assert joules_per_audio_hour(1000.0, 1090.0, 1800.0) == pytest.approx(180.0)  # 90 J for half an hour of audio
    with pytest.raises(ValueError, match="backwards"):
        joules_per_audio_hour(1000.0, 900.0, 10.0)
    with pytest.raises(ValueError, match="audio"):
        joules_per_audio_hour(0.0, 1.0, 0.0)


def event(key: str, count: int, device: str = "CUDA"):
    return SimpleNamespace(key=key, count=count, device_type=SimpleNamespace(name=device))


def test_count_kernels_counts_device_kernels_per_replay_only():
    events = [event("_gemv_kernel", 3 * 84), event("_rms_norm_kernel", 3 * 57), event("Memcpy DtoD (Device -> Device)", 3),
              event("Memset (Device)", 6), event("cudaGraphLaunch", 3, device="CPU")]
    assert count_kernels(events, replays=3) == 84 + 57


def test_offline_reports_the_throughput_runs_engine_thread_split_and_timeline(tmp_path):
    """A tiny random model on the CPU: the engine thread's shares of the timed throughput run, and the profiled rerun's
    summary (on the CPU its operators stand for the GPU's kernels)."""
    from qasr.bench.cli import offline_parser
    from qasr.bench.offline import run

    out = run(offline_parser().parse_args([
        "--size", "tiny", "--device", "cpu", "--num-clips", "3", "--slots", "4", "--tokens", "3",
        "--clip-seconds", "1.5",
        "--latency-runs", "1", "--step-runs", "1", "--independence-requests", "2", "--eager-requests", "1",
        "--timeline", "--freeze-heap", "--out", str(tmp_path / "offline.json")]))
    split = out["qasr_throughput_engine_thread"]
    assert set(split) >= {"admit", "decode_gpu", "decode_host", "idle"}
    assert split["admit"] > 0 and split["decode_gpu"] > 0  # the run admitted its clips and decoded them
    assert sum(split.values()) <= 1.0 + 1e-6  # shares of the run's wall time, never more than all of it
    loop = out["engine_step_ms"]  # a step as the engine loop makes it, reading each step and running ahead
    assert set(loop) == {"read_each", "run_ahead"} and all(set(by_rows) == {1} for by_rows in loop.values())
    assert all(ms > 0 for by_rows in loop.values() for ms in by_rows.values())
    assert out["engine_options"]["decode_run_ahead"] is True  # offline's
    admissions = out["qasr_throughput_admissions"]  # 3 clips, 4 slots: one admission, with nothing decoding
    assert admissions == {"admissions": 1, "admissions_alone": 1}
    assert out["qasr_frozen_objects"] > 10_000  # the loaded engine out of the collector's sight, as in the server
    gc_seen = out["qasr_throughput_gc"]  # every collection during the timed run, by generation
    assert len(gc_seen["collections"]) == 3 and gc_seen["longest_ms"] >= 0
    assert gc.get_freeze_count() == 0  # thawed once the bench is done
    timeline = out["qasr_throughput_timeline"]
    assert timeline["kernels"] > 0 and 0 < timeline["gpu_busy_fraction"] <= 1.0
    assert timeline["streams"] and all(s["top_kernels"] for s in timeline["streams"].values())


def test_offline_takes_the_engines_admission_options_from_its_command_line():
    from qasr.bench.cli import offline_parser
    from qasr.bench.offline import engine_overrides

    from qasr.engine.options import OFFLINE_DECODE_STEPS_AHEAD

    # the engine's offline default
    offline = {"decode_steps_ahead": OFFLINE_DECODE_STEPS_AHEAD, "decode_run_ahead": True}
    assert engine_overrides(offline_parser().parse_args([])) == offline
    args = offline_parser().parse_args(["--decode-steps-ahead", "2", "--admission-interval-ms", "0"])
    assert engine_overrides(args) == offline | {"decode_steps_ahead": 2, "admission_interval_ms": 0.0}
    args = offline_parser().parse_args(["--no-decode-run-ahead"])
    assert engine_overrides(args) == offline | {"decode_run_ahead": False}
    assert engine_overrides(offline_parser().parse_args(["--kv-int8"])) == offline | {"kv_int8": True}


def test_offline_on_an_int8_cache_checks_it_against_the_eager_path_on_one_and_against_a_bf16_cache():
    from qasr.bench.cli import offline_parser
    from qasr.bench.offline import run

    out = run(offline_parser().parse_args([
        "--size", "tiny", "--device", "cpu", "--num-clips", "2", "--slots", "4", "--tokens", "3", "--clip-seconds",
        "1.0", "--latency-runs", "1", "--step-runs", "1", "--independence-requests", "3", "--eager-requests", "2",
        "--kv-int8"]))
    assert out["engine_options"]["kv_int8"] is True
    checks = out["correctness"]
    assert checks["eager_bs1_exact_match"] == "2/2"  # the eager engine runs on an int8 cache too
    assert checks["bf16_reference_exact_match"].endswith("/3") and 0 <= checks["bf16_reference_token_agreement"] <= 1


def test_the_offline_bench_freezes_the_loaded_heap_unless_told_not_to():
    # as qasr-transcribe does: a full collection of the loaded engine stalled the GPU 129-183 ms (session 24)
    from qasr.bench.cli import offline_parser

    assert offline_parser().parse_args([]).freeze_heap is True
    assert offline_parser().parse_args(["--no-freeze-heap"]).freeze_heap is False


def test_the_step_floor_counts_an_fp8_lm_heads_bytes_only_where_the_gemv_streams_them():
    import torch
    from torch import nn

    from qasr.bench.offline import step_floors

    lm_head = nn.Linear(8, 100, bias=False, dtype=torch.bfloat16)  # 1,600 bytes in bf16, 800 + 400 of scales in FP8
    decoder = SimpleNamespace(lm_head=lm_head, embed_tokens=nn.Embedding(100, 8),
                              named_parameters=lambda: [("lm_head.weight", lm_head.weight)],
                              cfg=SimpleNamespace(head_dim=4, num_hidden_layers=1, num_key_value_heads=1))
    runner = SimpleNamespace(buckets=(1, 64), layer_ops=SimpleNamespace(gemv_rows=32))
    args = SimpleNamespace(context=0)

    def floors(fp8_lm_head: bool) -> dict:
        engine = SimpleNamespace(model=SimpleNamespace(decoder=decoder), runner=runner,
                                 options=SimpleNamespace(kv_int8=False, fp8_lm_head=fp8_lm_head))
        return step_floors(engine, args, bandwidth=1e3)  # bytes per ms: the floor in ms is bytes / 1e3 * 1e3

    assert floors(False) == {1: 1600.0, 64: 1600.0}
    assert floors(True) == {1: 1200.0, 64: 1600.0}  # 64 rows multiply the bf16 image on cuBLAS
