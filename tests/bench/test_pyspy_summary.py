"""bench/pyspy_summary.py: a thread's time by function from py-spy's raw folded stacks."""

from qasr.bench import pyspy_summary

# four processes (30 a child of 10, named after it; 100 not 10); the engine's main thread: 6 samples in step -> admit -> pad, 3 in step -> read (a native frame
# under it), 1 with `step` twice on the stack; another of its threads and another process must not count
RAW = """\
process 10:"python3 -m engine";thread (10): MainThread;run (engine/engine.py:680);step (engine/engine.py:190);admit (engine/engine.py:300);pad (torch/nn/functional.py:5096) 6
process 10:"python3 -m engine";thread (10): MainThread;run (engine/engine.py:680);step (engine/engine.py:191);read (engine/runner.py:250);cudaStreamSynchronize 3
process 10:"python3 -m engine";thread (10): MainThread;run (engine/engine.py:680);step (engine/engine.py:190);step (engine/engine.py:190) 1
process 10:"python3 -m engine";thread (11): qasr-engine-client;receive (engine/engine_client.py:80) 50
process 20:"python3 -m worker";thread (20): MainThread;serve (server/app.py:10) 70
process 10:"python3 -m engine";process 30:"spawned";thread (30): MainThread;child (x.py:1) 9
process 100:"another";thread (100): MainThread;other (y.py:1) 4
not a sample line
"""


def test_shares_of_one_thread_count_each_function_once_a_sample():
    shares = pyspy_summary.summarize(RAW.splitlines(), process="10", thread="MainThread")
    assert shares.samples == 10
    assert shares.inclusive["run [engine.py]"] == 10
    assert shares.inclusive["step [engine.py]"] == 10  # twice on one stack: once
    assert shares.inclusive["pad [functional.py]"] == 6
    assert shares.self == {"pad [functional.py]": 6, "cudaStreamSynchronize": 3, "step [engine.py]": 1}
    assert "receive [engine_client.py]" not in shares.inclusive and "serve [app.py]" not in shares.inclusive


def test_report_gives_shares_busiest_first_and_says_when_nothing_matched(capsys, tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    pyspy_summary.main([str(path), "--process", "10", "--thread", "MainThread", "--top", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "10 samples"
    assert lines[1:4] == ["inclusive:", "  100.0%  run [engine.py]", "  100.0%  step [engine.py]"]
    assert lines[4:7] == ["self:", "   60.0%  pad [functional.py]", "   30.0%  cudaStreamSynchronize"]
    assert pyspy_summary.report(pyspy_summary.summarize(RAW.splitlines(), thread="no such thread"), 5) == \
        "no samples matched"
