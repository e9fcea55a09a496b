"""bench/graph_priority.py needs a GPU: without one it says so and exits 2 (the measurement itself runs on the H200)."""

import pytest
import torch

from qasr.bench import graph_priority


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_without_a_gpu_it_refuses_with_exit_2(capsys):
    assert graph_priority.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
