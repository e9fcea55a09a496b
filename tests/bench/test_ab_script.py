"""bench/h200_ab.sh on the CPU: the base build comes from its archive and the candidate from the checkout, each run
alternately, and the summary reports every run's checks (the GPU figures it exists for come from the H200)."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = "model/ab_base_marker.txt"  # package data (qasr.model's *.txt): installed with the build it is in


def base_archive(path: Path) -> None:
    """HEAD as `git archive` gives it, plus a marker file only the base build has."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "HEAD"], capture_output=True,
                         check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as head, tarfile.open(path, "w") as out:
        for member in head.getmembers():
            out.addfile(member, head.extractfile(member) if member.isfile() else None)
        marker = tarfile.TarInfo(MARKER)
        marker.size = 4
        out.addfile(marker, io.BytesIO(b"base"))


def test_two_builds_run_alternately_and_the_summary_reports_each(tmp_path):
    base_archive(tmp_path / "base.tar")
    quick = ("--num-clips 2 --latency-runs 1 --step-runs 1 --independence-requests 2 --eager-requests 1 --slots 2 "
             "--clip-seconds 1.5 --tokens 3")
    env = os.environ | {"BASE_TAR": str(tmp_path / "base.tar"), "WORK": str(tmp_path / "work"),
                        "WHEELS": str(tmp_path / "no-wheels"), "DEVICE": "cpu", "DTYPE": "float32", "SIZES": "tiny",
                        "ROUNDS": "2", "OFFLINE_ARGS": quick}
    done = subprocess.run(["bash", "bench/h200_ab.sh", str(tmp_path / "out")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    order = [line.split(" rc=")[0] for line in summary.splitlines() if line.startswith("tiny round")]
    assert order == ["tiny round 1 base", "tiny round 1 candidate", "tiny round 2 base", "tiny round 2 candidate"]
    assert summary.count(" rc=0 ") == 4, summary
    lines = summary.splitlines()
    for run in ("tiny-1-base", "tiny-1-candidate", "tiny-2-base", "tiny-2-candidate"):
        line = next(i for i, text in enumerate(lines) if text.startswith(run))
        assert "identical rows failed [], batch independence 2/2, eager 1/1" in lines[line + 1]
    with tarfile.open(tmp_path / "out" / "runs.tar") as runs:
        assert {"./tiny-1-base.json", "./tiny-2-candidate.json", "./times.txt"} <= set(runs.getnames())
    work = tmp_path / "work"
    assert (work / "base" / "qasr" / MARKER).read_text() == "base"  # the base is the archive's build
    assert not (work / "candidate" / "qasr" / MARKER).exists()  # the candidate is the checkout's
