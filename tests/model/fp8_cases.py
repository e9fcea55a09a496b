"""Cases for qasr.model.fp8's activation kernel, run by test_fp8.py in a child pytest with TRITON_INTERPRET=1 (the
interpreter is chosen before the kernels are defined, as in kernel_cases.py): the kernel against PyTorch's formula
and cast bit for bit, every e4m3 value and tie included, and an FP8 product through it."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qasr.model import fp8, kernels

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/model/test_fp8.py"


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.abs().amax(1, keepdim=True).float() / 448).clamp(min=fp8.MIN_SCALE)
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def same(x: torch.Tensor) -> None:
    assert kernels.available(x.device)  # the kernel runs, not the PyTorch fallback
    q, scale = fp8.quantize_rows(x)
    q_ref, scale_ref = reference(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_kernel_rounds_every_e4m3_value_and_every_tie_as_pytorch():
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[values.isfinite()].sort().values
    ties = (values[:-1] + values[1:]) / 2  # round to nearest even, subnormals and exponent carries included
    row = torch.cat([values, ties, -ties, torch.tensor([448.0, -0.0, 1e-9, -1e-9])])
    same(row[None])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_pytorch_on_random_rows(dtype):
    torch.manual_seed(0)
    x = (torch.randn(9, 200) * torch.logspace(-4, 4, 9)[:, None]).to(dtype)
    x[4] = 0  # a padding row
    same(x)
    wide = torch.randn(3, 256).to(dtype)
    same(wide[:, :200])  # rows further apart than their width


def test_a_product_through_the_kernel_is_the_one_through_pytorch():
    torch.manual_seed(1)
    layer = nn.Linear(64, 32, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(20, 64, dtype=torch.bfloat16)
    q, scale = reference(x)
    expected = torch._scaled_mm(q, fp8.quantize_weight(layer.weight)[0].t(), scale_a=scale,
                                scale_b=fp8.quantize_weight(layer.weight)[1], bias=layer.bias,
                                out_dtype=torch.bfloat16)
    assert torch.equal(fp8.Fp8Linear(layer, min_rows=1)(x), expected)
    assert float((expected.float() - F.linear(x, layer.weight, layer.bias).float()).norm()
                 / F.linear(x, layer.weight, layer.bias).float().norm()) < 0.06
