"""engine_ab: engines that differ in their build-time options, on one model, their throughput runs alternating."""

import argparse
import json

import pytest

pytest.importorskip("torch")

from qasr.bench.engine_ab import main, parse_variant  # noqa: E402


def test_a_variant_is_a_name_and_engine_options_parsed_as_their_types():
    assert parse_variant("bf16") == ("bf16", {})
    assert parse_variant("int8:kv_int8=1") == ("int8", {"kv_int8": True})
    assert parse_variant("both:kv_int8=0,fp8_prefill=1,decode_steps_ahead=8") == (
        "both", {"kv_int8": False, "fp8_prefill": True, "decode_steps_ahead": 8})
    for bad in (":kv_int8=1", "x:no_such_option=1", "x:kv_int8=2", "x:kv_int8", "x:decode_steps_ahead=four"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)


def test_variants_alternate_and_each_is_compared_with_the_first(tiny_model_dir, capsys):
    """On the CPU with the tiny model: two engines with the same options must agree on every token, and the runs go
    through the variants in turn."""
    main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--num-clips", "3", "--slots", "2",
          "--tokens", "3", "--clip-seconds", "1.0", "--runs", "2", "--agreement-clips", "3", "--max-len", "128",
          "--variant", "a", "--variant", "same", "--variant", "int8:kv_int8=1"])
    out = capsys.readouterr().out
    runs = [json.loads(line) for line in out.splitlines() if line.startswith('{"run"')]
    assert [(r["run"], r["variant"]) for r in runs] == [(0, "a"), (0, "same"), (0, "int8"), (1, "a"), (1, "same"),
                                                         (1, "int8")]
    assert all(r["qasr_throughput_tokens_per_s"] > 0 for r in runs)
    summary = json.loads(out[out.index('{\n'):])["summary"]
    assert summary["same_vs_a"] == {"exact_match": "3/3", "token_agreement": 1.0}
    assert summary["int8_vs_a"]["exact_match"].endswith("/3")
    assert summary["a_identical_rows"] and summary["same_identical_rows"] and summary["int8_identical_rows"]
    assert summary["variants"] == {"a": {}, "same": {}, "int8": {"kv_int8": True}}
    assert summary["a_over_a"] == 1.0 and len(summary["int8_audio_s_per_s"]) == 2


def test_one_variant_is_refused():
    with pytest.raises(SystemExit):
        main(["--model", "unused", "--variant", "a"])
