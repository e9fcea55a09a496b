"""FP8 products (qasr.model.fp8): the FP8 linear against bfloat16, the swap, the opt-in from the command line to the
engine's model, and (in a child process through Triton's interpreter, fp8_cases.py) the activation kernel and the
GEMV path the swap must leave untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qasr.bench.offline import token_agreement
from qasr.engine.engine import Engine
from qasr.engine.options import QUANTIZE_MODES, EngineOptions
from qasr.engine.request import DecodeRequest
from qasr.model import fp8
from qasr.model.checkpoint import load_model
from qasr.server import cli

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_VALUES = E4M3_VALUES[E4M3_VALUES.isfinite()]


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    nn.init.normal_(layer.weight, std=in_features ** -0.5)
    return layer.requires_grad_(False)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.float() - reference).norm() / reference.norm())


@pytest.mark.parametrize("shape", [(37, 256, 96), (1, 64, 128), (300, 1024, 48)])
def test_fp8_linear_is_close_to_bfloat16(shape):
    M, K, N = shape
    layer = linear(K, N)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    x[0, 0] = 30.0  # an outlier: per-token scales keep the other tokens' precision
    reference = F.linear(x.float(), layer.weight.float())
    out = fp8.Fp8Linear(layer)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    # e4m3 keeps 3 mantissa bits (relative rounding <= 1/16 per operand): ~3-4% over a whole product
    assert relative_error(out, reference) < 0.06
    assert relative_error(F.linear(x, layer.weight), reference) < 0.01  # the bf16 product, for scale


def test_on_the_fp8_grid_the_product_is_exact_and_scales_go_per_token_and_per_channel():
    # rows whose largest magnitude is 448 have scale 1 and quantize exactly; a power of two per token (x) and per
    # output channel (w) moves only the scales, so the product must follow exactly (transposed scales would not)
    M, K, N = 8, 64, 32
    small = E4M3_VALUES[(E4M3_VALUES.abs() <= 16) & (E4M3_VALUES == E4M3_VALUES.round())]  # integers: exact sums
    x = small[torch.randint(len(small), (M, K))]
    w = small[torch.randint(len(small), (N, K))]
    x[:, 0], w[:, 1] = 448.0, -448.0
    x = x * 2.0 ** torch.arange(M)[:, None]
    w = w * 2.0 ** -torch.arange(N)[:, None].float()
    layer = nn.Linear(K, N, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    layer.weight.data = w.to(torch.bfloat16)
    out = fp8.Fp8Linear(layer)(x.to(torch.bfloat16))
    assert torch.equal(out, (x @ w.T).to(torch.bfloat16))


def test_widths_not_a_multiple_of_16_are_padded_and_any_leading_shape_works():
    layer = linear(40, 24)
    q = fp8.Fp8Linear(layer)
    assert q.weight_fp8.shape == (32, 48) and q.weight_scale.shape == (1, 32)
    assert q.weight_fp8.t().stride() == (1, 48)  # column-major mat2, as _scaled_mm on a GPU requires
    assert torch.all(q.weight_fp8[24:].float() == 0) and torch.all(q.weight_fp8[:, 40:].float() == 0)
    x = torch.randn(2, 3, 40, dtype=torch.bfloat16)
    out = q(x)
    assert out.shape == (2, 3, 24) and out.is_contiguous()
    assert relative_error(out, F.linear(x.float(), layer.weight.float())) < 0.06


def test_quantize_rows_scales_and_pads():
    x = torch.randn(5, 40, dtype=torch.bfloat16) * torch.tensor([1e-3, 1, 10, 100, 0])[:, None].to(torch.bfloat16)
    q, scale = fp8.quantize_rows(x, 48)
    assert q.shape == (5, 48) and q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    assert scale.dtype == torch.float32 and scale[4].item() == torch.tensor(fp8.MIN_SCALE).item()
    assert torch.all(q[4].float() == 0)
    assert torch.all(q[:, 40:].float() == 0)
    assert torch.allclose(q[:4, :40].float().abs().amax(1), torch.full((4,), 448.0))
    assert torch.allclose(q[:, :40].float() * scale, x.float(), rtol=1 / 16, atol=0)


def test_the_swap_keeps_the_bfloat16_weights_and_the_tie(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype="bfloat16")
    layers = len(model.decoder.layers)
    qkv = model.decoder.layers[0].self_attn.qkv_proj.weight
    state = {k: v.clone() for k, v in model.state_dict().items()}
    names = fp8.quantize(model, "fp8")
    assert len(names) == 4 * layers and fp8.quantized(model) == names
    assert not isinstance(model.decoder.lm_head, fp8.Fp8Linear)
    assert model.decoder.layers[0].self_attn.qkv_proj.weight is qkv  # the GEMV kernels read this Parameter
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    assert all(not isinstance(m, fp8.Fp8Linear) for m in model.encoder.modules())
    fp8.quantize(model, "fp8-lm-head")  # already swapped layers stay as they are
    assert len(fp8.quantized(model)) == 4 * layers + 1
    tied = load_model(tiny_model_dir, dtype="bfloat16")
    tied.decoder.lm_head.weight = tied.decoder.embed_tokens.weight
    fp8.quantize(tied, "fp8-lm-head")
    assert tied.decoder.lm_head.weight is tied.decoder.embed_tokens.weight


def test_modes_agree_and_unusable_setups_say_why(tiny_model_dir):
    assert tuple(fp8.MODES) == QUANTIZE_MODES
    with pytest.raises(ValueError, match="unknown quantize"):
        EngineOptions(quantize="int8")
    with pytest.raises(RuntimeError, match="needs a bfloat16 model"):
        fp8.quantize(load_model(tiny_model_dir, dtype="float32"))
    with pytest.raises(ValueError, match="unknown quantization"):
        fp8.quantize(load_model(tiny_model_dir, dtype="bfloat16"), "int4")


def test_the_command_line_opt_in_reaches_the_engine_options():
    args = cli.build_parser().parse_args(["--model", "m", "--device", "cpu", "--dtype", "bfloat16",
                                          "--quantize", "fp8"])
    cli.build_config(args)
    assert cli.engine_options(args).quantize == "fp8"
    args = cli.build_parser().parse_args(["--model", "m", "--device", "cpu"])
    assert cli.engine_options(args).quantize is None


@pytest.mark.parametrize("argv", [["--quantize", "fp8"], ["--quantize", "fp8", "--dtype", "float32"],
                                  ["--quantize", "int8", "--dtype", "bfloat16"]])
def test_quantize_without_a_bfloat16_model_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--model", "m", "--device", "cpu", *argv])
    assert caught.value.code == 2
    assert "--quantize" in capsys.readouterr().err


def test_engine_from_pretrained_quantizes_and_decodes(tiny_model_dir):
    # plain PyTorch on the CPU: every product is FP8 (no GEMV kernels here); the forced tokens are still decoded
    options = EngineOptions(num_slots=4, max_len=128, num_retained=0, ignore_eos=True, quantize="fp8")
    engine = Engine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="bfloat16", options=options)
    assert len(fp8.quantized(engine.model)) == 4 * len(engine.model.decoder.layers)
    audio = torch.sin(torch.arange(16000) / 8.0).numpy() * 0.3
    results = engine.transcribe([DecodeRequest(audio=audio, max_new_tokens=6)] * 3)
    assert all(len(r.token_ids) == 6 for r in results)
    assert results[0].token_ids == results[1].token_ids == results[2].token_ids


def test_token_agreement_counts_positions_and_prefixes():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    other = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9]]
    got = token_agreement(reference, other)
    assert got["exact_match"] == "1/3" and got["tokens"] == 10
    assert got["token_agreement"] == pytest.approx(8 / 10)
    assert got["prefix_agreement"] == pytest.approx((4 + 1 + 0) / 10)
    with pytest.raises(ValueError):
        token_agreement(reference, other[:2])


def test_interpreted_kernel_and_gemv_path():
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(here.parent),
         str(here / "fp8_cases.py")],
        env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=900,
    )
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and "failed" not in proc.stdout, report
