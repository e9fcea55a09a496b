"""The kernel-library comparison (bench/kernel_libraries.py): its references and qasr's side on the CPU through
Triton's interpreter, and its command line (the timing and the libraries' kernels need a GPU)."""

import pytest
from interpreted import run_interpreted

pytest.importorskip("triton")

from qasr.bench import kernel_libraries  # noqa: E402

CHILD = """
import json, torch
from qasr.bench import kernel_libraries as kl
# float32: the interpreter's bfloat16 is emulated (the GPU run compares bf16)
out = {case: kl.agreement(case, "qasr", 3, 64, 96, torch.device("cpu"), torch.float32) for case in kl.CASES}
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_qasr_side_agrees_with_the_references_in_the_interpreter():
    out = run_interpreted(CHILD, timeout=280)
    assert set(out) == {"add_rms_norm", "silu_mul"}
    for case, result in out.items():
        assert result["max_ref"] > 0.5, case  # the inputs are not zeros
        assert result["max_abs"] <= 1e-5 * result["max_ref"], (case, result)


def test_every_case_has_each_library_and_the_references_are_qwen3s():
    assert all(set(by_library) == {"qasr", "liger"} for _, by_library, _ in kernel_libraries.CASES.values())
    torch = pytest.importorskip("torch")
    x, r, w = torch.ones(1, 4), torch.full((1, 4), 2.0), torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.allclose(kernel_libraries.reference_add_rms_norm(x, r, w), w, atol=1e-5)  # rms of 3s is 3
    gate_up = torch.tensor([[0.0, 1.0, 5.0, 7.0]])
    assert torch.allclose(kernel_libraries.reference_silu_mul(gate_up), torch.tensor([[0.0, 7 * 0.7310586]]))


def test_an_unknown_library_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        kernel_libraries.main(["0.6B", "--libraries", "flashinfer"])
    assert "no kernels for ['flashinfer']" in capsys.readouterr().err
