"""The lm_head's weight rounded to FP8 (model/fp8_lm_head.py): the rounding itself, the rounded copy, and where the
option is refused. (Its GEMV kernels and an engine on them run through Triton's interpreter in kernel_cases.py.)"""

import pytest
import torch

from qasr.engine.engine import Engine
from qasr.engine.options import EngineOptions
from qasr.model import fp8_lm_head


def test_a_rounded_weight_is_e4m3_on_a_power_of_two_scale_per_row_and_its_image_is_exact():
    torch.manual_seed(0)
    w = torch.randn(64, 48) * torch.logspace(-4, 2, 64)[:, None]  # rows six decades apart
    w[5] = 0  # an all-zero row
    r = fp8_lm_head.round_weight(w.to(torch.bfloat16))
    assert r.values.dtype == fp8_lm_head.E4M3 and r.scales.dtype == torch.float32 and r.image.dtype == torch.bfloat16
    mantissa, _ = torch.frexp(r.scales)
    assert torch.all(mantissa == 0.5)  # powers of two
    assert torch.equal(r.image.float(), r.values.float() * r.scales[:, None])  # held exactly in bf16
    top = r.values.float().abs().amax(dim=1)
    live = torch.arange(64) != 5
    # the least power of two that fits each row: its largest value lands in e4m3's upper octave
    assert torch.all(top[live] <= fp8_lm_head.E4M3_MAX) and torch.all(top[live] > fp8_lm_head.E4M3_MAX / 2 - 16)
    assert r.scales[5] == 1 and not r.values[5].float().any()
    # to nearest with 3 mantissa bits: within 1/16 of each value (relative), where values are not subnormal
    wf = w.to(torch.bfloat16).float()
    normal = wf.abs() >= r.scales[:, None] * 2.0 ** -6
    assert torch.all((r.image.float() - wf).abs()[normal] <= wf.abs()[normal] / 16)


@pytest.fixture
def model(tiny_model_dir):
    return Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(num_slots=2)).model


def test_the_rounded_copy_holds_the_image_as_a_plain_weight_and_leaves_the_model_alone(model):
    before = {name: p.clone() for name, p in model.named_parameters()}
    copy = fp8_lm_head.rounded_copy(model)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    own = model.decoder.lm_head.weight
    assert torch.equal(copy.decoder.lm_head.weight, fp8_lm_head.round_weight(own).image)
    assert not torch.equal(copy.decoder.lm_head.weight, own)
    # the embeddings and the layers stay the model's (a tied lm_head was untied, not rounded with them)
    assert torch.equal(copy.decoder.embed_tokens.weight, model.decoder.embed_tokens.weight)
    assert copy.decoder.lm_head.weight is not copy.decoder.embed_tokens.weight
    assert torch.equal(copy.decoder.layers[0].mlp.down_proj.weight, model.decoder.layers[0].mlp.down_proj.weight)


def test_attach_rounds_the_lm_head_once_and_keeps_the_models_weight(model):
    weight = model.decoder.lm_head.weight.clone()
    fp8_lm_head.attach(model)
    first = model.decoder.lm_head.rounded
    fp8_lm_head.attach(model)  # an engine sharing the model: the graphs of the first read these tensors
    assert model.decoder.lm_head.rounded is first
    assert torch.equal(model.decoder.lm_head.weight, weight)
    assert not hasattr(model.decoder.layers[0].self_attn.qkv_proj, "rounded")


def test_an_fp8_lm_head_needs_the_fused_kernels(tiny_model_dir):
    with pytest.raises(ValueError, match="FP8 lm_head weights need the fused kernels"):
        Engine.from_pretrained(str(tiny_model_dir), device="cpu",
                               options=EngineOptions(num_slots=2, fused_kernels=False, fp8_lm_head=True))
