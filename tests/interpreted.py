"""Python code run in a child process under Triton's interpreter (TRITON_INTERPRET is read when Triton is imported,
so it cannot be switched on inside the test's own process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def run_interpreted(code: str, *args: str, timeout: float = 540, env: dict | None = None) -> dict:
    """Run `code` with `args` as its sys.argv[1:] in the interpreter -> the JSON object it printed last.
    Fails the test, with the child's stderr, if it exits non-zero. The child can import the tests' helpers."""
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, **(env or {}))
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
