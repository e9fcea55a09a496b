"""bench/h200_offline_pyspy.sh on the CPU: py-spy attached to an engine's throughput passes once the first is done,
the passes' figures and the engine thread's functions in the summary; without py-spy, a message saying how to get it.
(The profile it exists for comes from the H200: docs/benchmarks.md, session 21.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# 40 passes of 16 short clips: several seconds on a fast CPU, so the one second sampled falls inside them
TINY = {"SIZE": "tiny", "DEVICE": "cpu", "DTYPE": "float32", "CLIPS": "16", "SLOTS": "2", "RUNS": "40", "CLIP_S": "1.5",
        "TOKENS": "3", "SPY_S": "1"}


def run_script(tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "bench/h200_offline_pyspy.sh", str(tmp_path / "out")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed (pip install py-spy)")
def test_the_summary_has_each_pass_and_the_engine_threads_functions(tmp_path):
    env = os.environ | TINY | {"WORK": str(tmp_path / "work"), "WHEELS": str(tmp_path / "no-wheels")}
    done = run_script(tmp_path, env)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert [line.split(":")[0] for line in summary.splitlines() if line.startswith("pass ")] == \
        [f"pass {i}" for i in range(40)]
    assert "audio-s/s, mean batch 2; engine thread: admit" in summary
    assert "sweep [offline_sweep.py]" in summary  # sampled while the passes ran
    assert (tmp_path / "out" / "pyspy.txt").stat().st_size > 0


def test_without_py_spy_it_says_how_to_get_it(tmp_path):
    bin_dir = tmp_path / "bin"  # python3 and the shell's tools, no py-spy
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = os.environ | TINY | {"PATH": f"{bin_dir}:/usr/bin:/bin", "WORK": str(tmp_path / "work"),
                               "WHEELS": str(tmp_path / "no-wheels")}
    done = run_script(tmp_path, env)
    assert done.returncode == 1
    assert "no py-spy: pip download it into" in done.stderr
    assert not (tmp_path / "work").exists()  # refused before installing anything
