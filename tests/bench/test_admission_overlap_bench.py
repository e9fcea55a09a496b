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
