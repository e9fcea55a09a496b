"""bench/offline_summary.py: an offline run's JSON in the two lines the H200 scripts' summaries print."""

import json

from qasr.bench import offline_summary

CHECKS = {"identical_rows_failed_buckets": [], "batch_independence_exact_match": "8/8",
          "eager_bs1_exact_match": "2/2"}


def test_a_gpu_run_shows_its_step_energy_kernels_checks_and_picks():
    run = {"decode_step_ms": {"1": 0.7841, "32": 1.122}, "qasr_bs1_latency_ms": 44.31,
           "qasr_throughput_audio_s_per_s": 7488.4, "qasr_energy_j_per_audio_hour": 290.2,
           "decode_kernels_per_step": {"1": 227.0}, "correctness": CHECKS,
           "engine_step_ms": {"read_each": {"1": 0.9012, "16": 1.0}, "run_ahead": {"1": 0.8011, "16": 0.95}},
           "gemv_configs": {"products N=1024 K=3072 bfloat16": "GemvConfig(block_n=64, split=8)"}}
    first, second = offline_summary.run_lines(run, "0.6B-1-candidate")
    assert first.startswith("0.6B-1-candidate ")
    assert "step ms 1:0.784 / 32:1.122 | latency 44.3 ms | 7,488 audio-s/s | 290 J/audio-h" in first
    assert 'kernels a step {"1": 227.0}' in first
    assert first.endswith("engine loop step ms read_each 1:0.901 / 16:1.000; run_ahead 1:0.801 / 16:0.950")
    assert second.strip() == ("identical rows failed [], batch independence 8/8, eager 2/2; "
                              "gemv products N=1024 K=3072: (block_n=64, split=8)")


def test_what_a_cpu_run_did_not_measure_shows_as_a_dash(tmp_path, capsys):
    run = {"qasr_bs1_latency_ms": 11.5, "qasr_throughput_audio_s_per_s": 298, "gemv_configs": {},
           "correctness": CHECKS | {"identical_rows_failed_buckets": [4]}}
    (tmp_path / "tiny-1-base.json").write_text(json.dumps(run))
    offline_summary.main([str(tmp_path / "tiny-1-base.json")])
    first, second = capsys.readouterr().out.splitlines()
    assert "step ms - |" in first and "- J/audio-h" in first and "kernels" not in first and "loop" not in first
    assert "identical rows failed [4]" in second and second.endswith("gemv -")


def test_the_throughput_runs_admissions_and_collections_follow_the_checks():
    run = {"qasr_bs1_latency_ms": 40.0, "qasr_throughput_audio_s_per_s": 9000, "gemv_configs": {},
           "correctness": CHECKS, "qasr_throughput_admissions": {"admissions": 12, "admissions_alone": 3},
           "qasr_throughput_gc": {"collections": [40, 3, 1], "ms": [1.0, 2.0, 162.0], "longest_ms": 162.0}}
    _, second = offline_summary.run_lines(run, "0.6B")
    assert second.endswith("gemv -; throughput run: 12 admissions, 3 with nothing decoding; collections [40, 3, 1] "
                           "(generations 0/1/2), the longest 162.0 ms")


def test_an_int8_cache_run_shows_its_agreement_with_a_bf16_cache():
    run = {"qasr_bs1_latency_ms": 40.0, "qasr_throughput_audio_s_per_s": 9000, "gemv_configs": {},
           "correctness": CHECKS | {"bf16_reference_exact_match": "20/24", "bf16_reference_token_agreement": 0.9612}}
    _, second = offline_summary.run_lines(run, "0.6B-int8")
    assert second.strip() == ("identical rows failed [], batch independence 8/8, eager 2/2, against bf16 "
                              "20/24 (96.1% of tokens); gemv -")
