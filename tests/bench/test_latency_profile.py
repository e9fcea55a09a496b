"""bench/latency_profile.py on the CPU with the tiny model: every admission function it names is one the engine
calls once for a batch-1 request, and its per-call timings add up within the request's own."""

import json

import pytest

pytest.importorskip("torch")

from qasr.bench import latency_profile  # noqa: E402


def test_the_latency_profile_times_each_admission_function_of_a_request(tiny_model_dir, capsys, tmp_path):
    latency_profile.main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--runs", "2",
                          "--tokens", "4", "--slots", "4", "--prefill-tokens", "4096", "--trace",
                          str(tmp_path / "trace.json")])
    out = json.loads(capsys.readouterr().out)
    calls = out["host_calls"]
    for name in ("runner.log_spectrogram", "runner.embed_chunks", "runner.encode", "runner.embed_prompts",
                 "runner.prefill", "frontend.run", "engine._encode", "engine._admit_together"):
        assert calls[name]["calls_a_request"] == 1, name  # a renamed function would vanish from the report
    assert "runner.chunk_extremes" not in calls  # a final's mel maximum stays on the device: no host read
    stages = ("runner.log_spectrogram", "runner.embed_chunks", "runner.encode")
    assert sum(calls[n]["ms_a_request"] for n in stages) <= calls["frontend.run"]["ms_a_request"]
    assert calls["engine._encode"]["ms_a_request"] <= calls["engine._admit_together"]["ms_a_request"] \
        <= out["latency_ms"]
    assert set(out["breakdown_ms"]) >= {"encode_ms", "prefill_ms", "decode_ms"}
    assert out["profile"]["cpu_self_ms_a_request"] and out["profile"]["gpu_kernels_a_request"] == 0  # no GPU here
    assert (tmp_path / "trace.json").stat().st_size > 0
