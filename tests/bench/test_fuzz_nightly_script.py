"""bench/fuzz_nightly.sh at a tiny count: each shard its own seed from SEED_BASE (by default today's date, so a nightly
run does not replay the sequences of the night before), the examples summed per adapter, the seeds named."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_script(out: Path, seed_base: str | None) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # the python3 that has qasr's test deps
    env = os.environ | {"PATH": path, "EXAMPLES": "12", "SHARDS": "2", "JOBS": "2", "ADAPTERS": "native"}
    env.pop("SEED_BASE", None)
    if seed_base is not None:
        env["SEED_BASE"] = seed_base
    return subprocess.run(["bash", "bench/fuzz_nightly.sh", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_each_shard_runs_its_own_seed_and_the_summary_names_them(tmp_path):
    done = run_script(tmp_path, "41")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "native: 12 examples passed over 2 shards (seeds 42-43), 0 shard(s) failed" in summary
    assert sorted((tmp_path / "shards.txt").read_text().split("\n")[:2]) == ["native 42 rc=0", "native 43 rc=0"]
    assert {p.name for p in tmp_path.glob("fuzz-*.log")} == {"fuzz-native-42.log", "fuzz-native-43.log"}


def test_the_default_seeds_come_from_the_date(tmp_path):
    before = datetime.date.today().strftime("%Y%m%d")
    done = run_script(tmp_path, None)
    after = datetime.date.today().strftime("%Y%m%d")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert any(f"(seeds {day}001-{day}002)" in summary for day in {before, after}), summary
