"""FP8 products for the admissions (qasr.model.fp8) on the CPU: the FP8 linear against bfloat16, the products below
its row threshold untouched, the swap, and (in a child pytest through Triton's interpreter, fp8_cases.py) the
activation kernel bit for bit against PyTorch's cast."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qasr.model import fp8
from qasr.model.checkpoint import load_model


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def linear(in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    nn.init.normal_(layer.weight, std=in_features ** -0.5)
    if bias:
        nn.init.normal_(layer.bias, std=0.5)
    return layer.requires_grad_(False)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.float() - reference).norm() / reference.norm())


@pytest.mark.parametrize("shape", [(37, 256, 96), (1, 64, 128), (300, 1024, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_close_to_bfloat16(shape, bias):
    M, K, N = shape
    layer = linear(K, N, bias)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    x[0, 0] = 30.0  # an outlier: per-row scales keep the other rows' precision
    reference = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    out = fp8.Fp8Linear(layer, min_rows=1)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    # e4m3 keeps 3 mantissa bits (relative rounding <= 1/16 per operand): ~3-4% over a whole product
    assert relative_error(out, reference) < 0.06
    assert relative_error(F.linear(x, layer.weight, layer.bias), reference) < 0.01  # the bf16 product, for scale


def test_on_the_fp8_grid_the_product_is_exact_and_scales_go_per_row_and_per_channel():
    # rows whose largest magnitude is 448 have scale 1 and quantize exactly; a power of two per row (x) and per output
    # channel (w) moves only the scales, so the product must follow exactly (transposed scales would not)
    grid = torch.tensor([0.5, -1.0, 2.0, 448.0, -3.5, 0.25, 1.5, -448.0] * 4)
    x = grid.repeat(4, 1).roll(1, 0) * torch.tensor([1.0, 2.0 ** -3, 2.0 ** 5, 1.0])[:, None]
    layer = linear(32, 16)
    layer.weight.copy_((grid.roll(3).repeat(16, 1) * torch.tensor([2.0 ** (i % 5 - 2) for i in range(16)])[:, None]))
    out = fp8.Fp8Linear(layer, min_rows=1)(x.to(torch.bfloat16))
    assert torch.equal(out, F.linear(x.double(), layer.weight.double()).to(torch.bfloat16))


def test_products_below_the_row_threshold_are_the_bfloat16_ones_exactly():
    layer = linear(64, 48, bias=True)
    swapped = fp8.Fp8Linear(layer, min_rows=16)
    small, large = torch.randn(15, 64, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16)
    assert torch.equal(swapped(small), layer(small))  # a decode bucket: what it computed before the swap
    assert not torch.equal(swapped(large), layer(large))  # from the threshold on: FP8
    assert swapped.weight is layer.weight and swapped.bias is layer.bias  # a state_dict is unchanged
    leading = torch.randn(2, 9, 64, dtype=torch.bfloat16)  # the encoder's [windows, tokens, D]: 18 rows
    assert swapped(leading).shape == (2, 9, 48)
    assert torch.equal(swapped(leading).view(18, 48), swapped(leading.view(18, 64)))


def test_identical_rows_give_identical_products():
    # per-row scales: a row's quantization never depends on its batch mates
    layer = fp8.Fp8Linear(linear(128, 64), min_rows=1)
    x = torch.randn(24, 128, dtype=torch.bfloat16)
    x[5] = x[17] = x[3]
    out = layer(x)
    assert torch.equal(out[5], out[3]) and torch.equal(out[17], out[3])


def test_layers_whose_features_are_not_multiples_of_16_are_refused_and_left_alone():
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.Fp8Linear(linear(40, 64))


def test_quantize_swaps_the_decoder_and_encoder_products_and_keeps_the_weights(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype="bfloat16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    swapped = fp8.quantize(model, min_rows=4)
    layers, encoder_layers = len(model.decoder.layers), len(model.encoder.layers)
    assert len(swapped) == 4 * layers + 6 * encoder_layers
    assert sorted(swapped) == sorted(fp8.quantized(model))
    assert "decoder.layers.0.mlp.down_proj" in swapped and "encoder.layers.0.fc1" in swapped
    assert not any("lm_head" in name or "embed" in name for name in swapped)  # the argmax's layer stays bf16
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert fp8.quantize(model, min_rows=4) == []  # already swapped


def test_a_model_that_is_not_bfloat16_is_refused_with_the_reason(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype="float32")
    with pytest.raises(RuntimeError, match="bfloat16 model"):
        fp8.quantize(model)


@pytest.mark.timeout(600)
def test_activation_kernel_cases_through_the_interpreter():
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(here.parent),
         str(here / "fp8_cases.py")],
        env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=540,
    )
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and "failed" not in proc.stdout, report
