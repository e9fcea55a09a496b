"""The architecture contracts in pyproject.toml ([tool.importlinter]): `lint-imports` must keep every one (arrows
point down: server -> streaming, engine -> model; the stream path, the client, audio and the wire protocols import
no torch, engine or server; model nothing of qasr above it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_lint_imports_keeps_every_architecture_contract():
    lint_imports = Path(sys.executable).with_name("lint-imports")  # installed with the test extra
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
