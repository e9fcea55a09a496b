"""python -m qasr.bench.admission_overlap on the CPU with the tiny model: both orders run the same load, every partial
is answered or superseded, and the figures land in OUT/admission_overlap.json."""

import json

from qasr.bench import admission_overlap


def test_the_bench_runs_both_orders_and_writes_its_figures(tmp_path):
    admission_overlap.main(["--device", "cpu", "--steps", "12", "--rows", "2", "--streams", "3", "--per-admission", "2",
                            "--slots", "8", "--max-seconds", "2", "--rounds", "1", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "admission_overlap.json").read_text())
    assert [run["overlap"] for run in out["runs"]] == [False, True]
    for run in out["runs"]:
        assert run["steps"] >= 12 and run["partials_answered"] >= 1 and run["host_reads_per_step"] >= 1
        assert set(run["seconds"]) == {"admit", "decode_gpu", "decode_host"}


def test_the_sync_audit_counts_each_wait_by_its_qasr_call_site():
    """On a CPU there is no sync debug mode: code run as if it were a qasr module warns as CUDA's mode does."""
    import warnings

    namespace = {"warnings": warnings, "__name__": "qasr.engine.waiting"}
    exec(compile("def wait():\n    warnings.warn('called a synchronizing CUDA operation')\n", "waiting.py", "exec"),
         namespace)

    def load():
        for _ in range(3):
            namespace["wait"]()
        warnings.warn("an unrelated warning")  # not a wait: not counted
        return "done"

    result, sites = admission_overlap.audit_syncs(load, cuda=False)
    assert result == "done"
    assert sites == {"waiting.py:2 wait": 3}


def test_phases_time_the_engine_threads_pieces_of_the_overlapped_runs(tmp_path):
    admission_overlap.main(["--device", "cpu", "--steps", "12", "--rows", "2", "--streams", "3", "--per-admission", "2",
                            "--slots", "8", "--max-seconds", "2", "--rounds", "1", "--phases", "--out", str(tmp_path)])
    runs = json.loads((tmp_path / "admission_overlap.json").read_text())["runs"]
    assert "phases" not in runs[0]  # the overlap off: untimed
    phases = runs[1]["phases"]
    assert set(phases) == {phase for phase, _, _ in admission_overlap.PHASES}
    assert phases["admissions"]["calls"] >= 1 and phases["launch"]["calls"] >= 12 and phases["read"]["calls"] >= 12
    assert phases["mel"]["calls"] + phases["mel_finals"]["calls"] >= phases["admissions"]["calls"]
    assert phases["mel_read"]["calls"] == phases["mel"]["calls"] >= 1 and phases["prefill"]["calls"] >= 1  # partials
    # nested phases take no more than the admission around them, all less than the run
    inner = sum(phases[p]["ms_per_admission"]
                for p in ("prepare", "mel", "floor", "mel_finals", "conv", "encoder", "prompts", "prefill"))
    assert 0 < inner <= phases["admissions"]["ms_per_admission"] + phases["prepare"]["ms_per_admission"]
    assert all(0 <= v["share"] < 1 for v in phases.values())


def test_phase_timers_count_calls_and_take_their_wrappers_off():
    classes = {key: type(key, (), {name: (lambda self, x=0: x + 1) for _, o, name in admission_overlap.PHASES
                                   if o == key}) for key in ("engine", "frontend", "runner")}
    engine = classes["engine"]()
    engine.frontend, engine.runner = classes["frontend"](), classes["runner"]()
    with admission_overlap.phase_timers(engine) as spent:
        assert engine.runner.prefill(1) == 2 and engine.runner.prefill() == 1 and engine._prepare() == 1
    assert spent["prefill"][0] == 2 and spent["prepare"][0] == 1 and spent["read"] == [0, 0.0]
    assert "prefill" not in vars(engine.runner) and "_prepare" not in vars(engine)  # the class's methods again
