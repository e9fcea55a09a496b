"""bench/aligner_cost.py on the tiny model and aligner (CPU): the JSON it prints has the aligner alone per batch and
the engine with and without words, with per-final costs that add up."""

import json

from qasr.bench import aligner_cost


def test_prints_aligner_cost_per_final_batched_and_alone(tiny_model_dir, tiny_aligner_dir, tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert aligner_cost.main(["--model", str(tiny_model_dir), "--aligner", str(tiny_aligner_dir), "--device", "cpu",
                              "--batches", "1,3", "--seconds", "1.5", "--tokens", "4", "--repeats", "1",
                              "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    assert report["device"] == "cpu" and report["cuda_graphs"] is False
    assert [row["batch"] for row in report["aligner"]] == [1, 3]
    for row in report["aligner"]:
        for path in ("eager", "graphed"):  # on a CPU the graphed path runs its padded buffers eagerly
            call, final = row[f"{path}_ms_per_call"], row[f"{path}_ms_per_final"]
            assert call > 0 and abs(final - call / row["batch"]) < 0.01
        assert row["same_classes"] is True
        assert row["words_per_final"] == 4  # 1.5 s x 2.5 words a second
    # overlap: each batch twice in the one run, decoding at the aligner's priority and above it (on a CPU there are
    # no streams: both at 0, and the alignment runs synchronously, so no step runs during it)
    assert [(row["batch"], row["prioritized"]) for row in report["overlap"]] == [
        (1, False), (3, False), (1, True), (3, True)]
    assert all(row["decode_priority"] == 0 for row in report["overlap"])
    assert all(row["aligner_priority"] == 0 and row["step_ms_alone"] > 0 for row in report["overlap"])
    assert [row["batch"] for row in report["engine"]] == [1, 3]
    assert all(row["align_ms_per_final"] > 0 and row["with_words_ms"] > 0 for row in report["engine"])


def test_bad_arguments_exit_2(capsys):
    assert aligner_cost.main(["--batches", "0"]) == 2
    assert "positive" in capsys.readouterr().err


def test_priority_off_measures_overlap_once_per_batch(tiny_model_dir, tiny_aligner_dir, capsys):
    assert aligner_cost.main(["--model", str(tiny_model_dir), "--aligner", str(tiny_aligner_dir), "--device", "cpu",
                              "--batches", "2", "--seconds", "1", "--repeats", "1", "--priority", "off",
                              "--skip-engine"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(row["batch"], row["prioritized"]) for row in report["overlap"]] == [(2, False)]
    assert "engine" not in report
