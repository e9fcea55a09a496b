"""The fused Triton kernels (model/kernels.py) on the CPU, through Triton's interpreter.

The interpreter is chosen when the kernels are defined, so the cases (kernel_cases.py) run in a child pytest with
TRITON_INTERPRET=1; this test passes when all of them pass and shows their report when one fails.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from qasr.engine.runner import FUSED_CONV1_ENV  # noqa: E402


@pytest.mark.timeout(1500)  # ~9 minutes alone on a 2-core AMD EPYC CI host (session 17); more beside other work
def test_fused_kernels_match_the_pytorch_reference():
    here = Path(__file__).resolve().parent
    # The engines there run the decoder's kernels with PyTorch's first convolution: its kernel takes the interpreter
    # ~17 s a chunk, and kernel_cases tests it on its own and in one engine (which turns it back on)
    env = dict(os.environ, TRITON_INTERPRET="1", **{FUSED_CONV1_ENV: "0"})
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(here.parent),
             str(here / "kernel_cases.py")],
            env=env, capture_output=True, text=True, timeout=1440,
        )
    except subprocess.TimeoutExpired as e:  # show how far it got
        pytest.fail(f"the kernel cases ran past {e.timeout} s:\n{(e.stdout or b'')[-6000:]!r}")
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and "failed" not in proc.stdout, report
