"""bench/padding_count.py: the admissions' padding counted from logged shapes through the runner's bucket rules."""

import json

from qasr.bench import padding_count


def test_counts_follow_the_runners_rules_before_and_now(tmp_path, capsys):
    log = tmp_path / "shapes.1"
    # one admission of three prompts (25, 70, 100 tokens) and one encoder call of three windows (14, 53, 104 positions)
    log.write_text(json.dumps(["prefill", [25, 70, 100]]) + "\n" + json.dumps(["encode", [14, 53, 104]]) + "\n")
    out = tmp_path / "counts.json"
    padding_count.main([str(log), "--regroup", "--json", str(out)])
    rows = {row["rule"]: row for row in json.loads(out.read_text())}
    # before: 3 sequences pad to a bucket of 4, each to the longest rounded up to 64 (128); now to the ladder's 112
    assert rows["prefill before (64-step)"]["computed"] == 4 * 128
    assert rows["prefill now"]["computed"] == 4 * 112 and rows["prefill now"]["real"] == 195
    # before: every window whole (104) and 3 windows in a bucket of 4; now 14 -> 32, 53 -> 56, 104 -> 104, one each
    assert rows["encoder before (whole windows)"]["computed"] == 4 * 104
    assert rows["encoder now"]["computed"] == 32 + 56 + 104 and rows["encoder now"]["replays"] == 3
    assert "padding" in capsys.readouterr().out


def test_a_log_without_encoder_calls_is_counted_without_dividing_by_zero(tmp_path, capsys):
    log = tmp_path / "shapes.1"
    log.write_text(json.dumps(["prefill", [40]]) + "\n")
    padding_count.main([str(log), "--regroup"])
    assert "no calls logged" in capsys.readouterr().out


def test_the_hook_is_written_where_asked(tmp_path):
    padding_count.main(["--write-hook", str(tmp_path / "hook")])
    assert "QASR_PADLOG" in (tmp_path / "hook" / "sitecustomize.py").read_text()
