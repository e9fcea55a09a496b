"""Cases for qasr.model.fp8 that need Triton's interpreter, run by test_fp8.py in a child pytest with
TRITON_INTERPRET=1 (chosen before the kernels are defined, as kernel_cases.py): the activation quantization kernel
against the PyTorch formula bit for bit, and the decode step's GEMV buckets untouched by the swap."""

import copy
import os

import pytest
import torch

from qasr.model import fp8
from qasr.model.checkpoint import load_model
from qasr.model.modeling import FusedLayerOps

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/model/test_fp8.py"


def reference(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.abs().amax(1, keepdim=True).float() / 448).clamp(min=fp8.MIN_SCALE)
    q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.nn.functional.pad(q, (0, width - x.shape[1])), scale


def same(x: torch.Tensor, width: int) -> None:
    q, scale = fp8.quantize_rows(x, width)
    q_ref, scale_ref = reference(x, width)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref)


def test_kernel_rounds_every_e4m3_value_and_every_tie_as_pytorch():
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[values.isfinite()].sort().values
    ties = (values[:-1] + values[1:]) / 2  # round to nearest even, subnormals and exponent carries included
    row = torch.cat([values, ties, -ties, torch.tensor([448.0, -0.0, 1e-9, -1e-9])])
    same(row[None], row.numel() + 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_pytorch_on_random_rows(dtype):
    torch.manual_seed(0)
    x = (torch.randn(9, 200) * torch.logspace(-4, 4, 9)[:, None]).to(dtype)
    x[4] = 0  # a padding row
    same(x, 208)
    wide = torch.randn(3, 256).to(dtype)
    same(wide[:, :200], 208)  # rows further apart than their width


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    plain = load_model(tiny_model_dir, dtype="bfloat16")
    quantized = copy.deepcopy(plain)
    fp8.quantize(quantized, "fp8-lm-head")
    return plain, quantized


def decode_logits(model, rows: int, gemv_rows: int) -> torch.Tensor:
    torch.manual_seed(1)
    cache = model.new_cache(rows, 64)
    ops = FusedLayerOps(model.decoder.rope_table(cache.length), gemv_rows=gemv_rows)
    tokens = torch.randint(model.cfg.text.vocab_size, (rows,))
    positions = torch.arange(rows) % 5
    return model.decoder.decode(tokens, positions, cache, ops)


def test_gemv_buckets_give_identical_logits_with_and_without_the_swap(models):
    plain, quantized = models
    assert torch.equal(decode_logits(plain, 4, gemv_rows=8), decode_logits(quantized, 4, gemv_rows=8))


def test_larger_buckets_multiply_in_fp8(models):
    plain, quantized = models
    a, b = decode_logits(plain, 16, gemv_rows=8), decode_logits(quantized, 16, gemv_rows=8)
    assert not torch.equal(a, b)  # the FP8 products ran
    # ~4% per product, compounded through the random layers (and the interpreter's truncating bf16 casts): a wrong
    # scale or layout would be off by the logits' whole size
    assert float((a.float() - b.float()).norm() / a.float().norm()) < 0.25
