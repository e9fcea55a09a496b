"""The offline bench's arithmetic for energy per audio hour and kernels per decode step (the GPU parts that feed it,
NVML's counter and the profiler over graph replays, run only on the H200)."""

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
