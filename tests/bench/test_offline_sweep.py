"""offline_sweep: every combination of the varied scheduling options runs in turn on one loaded engine."""

import argparse
import json

import pytest

pytest.importorskip("torch")

from qasr.bench.offline_sweep import combinations, main, parse_vary  # noqa: E402


def test_vary_parses_an_option_and_its_values_and_refuses_others():
    assert parse_vary("max_prefill_tokens=8192,32768") == ("max_prefill_tokens", [8192, 32768])
    assert parse_vary("admission_interval_ms=0,2.5") == ("admission_interval_ms", [0.0, 2.5])
    assert parse_vary("freeze_heap=1") == ("freeze_heap", [True])
    for bad in ("num_slots=4", "decode_steps_ahead=", "decode_steps_ahead=four", "decode_steps_ahead=0",
                "max_prefill_tokens=64,-1", "freeze_heap=2", "freeze_heap=yes"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_vary(bad)
    assert combinations([("decode_steps_ahead", [1, 4]), ("max_prefill_tokens", [64])]) == [
        {"decode_steps_ahead": 1, "max_prefill_tokens": 64}, {"decode_steps_ahead": 4, "max_prefill_tokens": 64}]


def test_sweep_runs_each_setting_in_turn_and_the_engine_uses_it(tiny_model_dir, capsys, monkeypatch):
    """On the CPU with the tiny model: a prefill budget of one clip's prompt admits the clips one at a time, a large one
    admits them together, and each timed run decodes every clip (the run's tokens per second count them)."""
    from qasr.engine import engine as engine_module

    admitted: list[tuple[int, int]] = []  # (the budget in force, clips admitted together)
    original = engine_module.Engine._admit_apart

    def record(self, seqs, *args, **kwargs):
        admitted.append((self.options.max_prefill_tokens, len(seqs)))
        return original(self, seqs, *args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "_admit_apart", record)
    main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--num-clips", "3", "--slots", "4",
          "--tokens", "2", "--clip-seconds", "1.0", "--runs", "2", "--vary", "max_prefill_tokens=1,100000"])
    lines = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in lines if line.startswith('{"run"')]
    assert [(r["run"], r["max_prefill_tokens"]) for r in records] == [(0, 1), (0, 100000), (1, 1), (1, 100000)]
    assert all(r["qasr_throughput_clips"] == 3 and r["qasr_throughput_tokens_per_s"] > 0 for r in records)
    # every clip decoded its 2 tokens: the tokens a second over the audio a second are 2 per 1 s clip
    assert all(r["qasr_throughput_tokens_per_s"] == pytest.approx(2 * r["qasr_throughput_audio_s_per_s"])
               for r in records)
    assert {n for budget, n in admitted if budget == 1} == {1}  # the first clip is always taken, then none fits
    assert max(n for budget, n in admitted if budget == 100000) == 3
