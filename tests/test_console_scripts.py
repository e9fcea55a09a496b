"""Every console script answers --help without importing torch, so at once even on a small machine: each runs with a
stand-in `torch` package first on the path that fails to import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = [["qasr-server"], ["qasr-mic"], ["qasr-transcribe"],
            ["qasr-make-test-model"], ["qasr-bench"], ["qasr-bench", "offline"], ["qasr-bench", "stream"],
            ["qasr-bench", "partial-reuse"]]


@pytest.fixture(scope="module")
def torch_blocked_env(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("no-torch")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text('raise ImportError("torch is blocked: --help must not need it")\n')
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_answers_without_importing_torch(command, torch_blocked_env):
    script = Path(sys.executable).with_name(command[0])
    if not script.exists():
        pytest.skip(f"{command[0]} is not installed beside {sys.executable} (pip install -e .)")
    done = subprocess.run([str(script), *command[1:], "--help"], env=torch_blocked_env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {' '.join(command)} ")


def test_the_stand_in_really_blocks_torch(torch_blocked_env):
    done = subprocess.run([sys.executable, "-c", "import torch"], env=torch_blocked_env, capture_output=True, text=True)
    assert done.returncode != 0 and "torch is blocked" in done.stderr
