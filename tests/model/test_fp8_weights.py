"""The decoder's weights rounded to FP8 (model/fp8_weights.py): the rounding itself, the rounded copy, and where the
option is refused. (Its GEMV kernels and an engine on them run through Triton's interpreter in kernel_cases.py.)"""

import pytest
import torch

from qasr.engine.engine import Engine
from qasr.engine.options import EngineOptions
from qasr.model import fp8_weights


def test_a_rounded_weight_is_e4m3_on_a_power_of_two_scale_per_row_and_its_image_is_exact():
    torch.manual_seed(0)
    w = torch.randn(64, 48) * torch.logspace(-4, 2, 64)[:, None]  # rows six decades apart
    w[5] = 0  # an all-zero row
    r = fp8_weights.round_weight(w.to(torch.bfloat16))
    assert r.values.dtype == fp8_weights.E4M3 and r.scales.dtype == torch.float32 and r.image.dtype == torch.bfloat16
    mantissa, _ = torch.frexp(r.scales)
    assert torch.all(mantissa == 0.5)  # powers of two
    assert torch.equal(r.image.float(), r.values.float() * r.scales[:, None])  # held exactly in bf16
    top = r.values.float().abs().amax(dim=1)
    live = torch.arange(64) != 5
    # the least power of two that fits each row: its largest value lands in e4m3's upper octave
    assert torch.all(top[live] <= fp8_weights.E4M3_MAX) and torch.all(top[live] > fp8_weights.E4M3_MAX / 2 - 16)
    assert r.scales[5] == 1 and not r.values[5].float().any()
    # to nearest with 3 mantissa bits: within 1/16 of each value (relative), where values are not subnormal
    wf = w.to(torch.bfloat16).float()
    normal = wf.abs() >= r.scales[:, None] * 2.0 ** -6
    assert torch.all((r.image.float() - wf).abs()[normal] <= wf.abs()[normal] / 16)


def test_the_rounded_copy_holds_the_images_as_plain_weights_and_leaves_the_model_alone(tiny_model_dir):
    engine = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(num_slots=2))
    model = engine.model
    before = {name: p.clone() for name, p in model.named_parameters()}
    copy = fp8_weights.rounded_copy(model)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    products = [(layer.get_submodule(name), copy_layer.get_submodule(name))
                for layer, copy_layer in zip(model.decoder.layers, copy.decoder.layers)
                for name in fp8_weights.PRODUCTS] + [(model.decoder.lm_head, copy.decoder.lm_head)]
    for own, rounded in products:
        assert torch.equal(rounded.weight, fp8_weights.round_weight(own.weight).image)
        assert not torch.equal(rounded.weight, own.weight)
    # the embeddings stay the model's (a tied lm_head was untied, not rounded with them)
    assert torch.equal(copy.decoder.embed_tokens.weight, model.decoder.embed_tokens.weight)
    assert copy.decoder.lm_head.weight is not copy.decoder.embed_tokens.weight


def test_attach_rounds_each_product_once_and_keeps_the_models_weights(tiny_model_dir):
    engine = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(num_slots=2))
    model = engine.model
    lm_head = model.decoder.lm_head.weight.clone()
    count = fp8_weights.attach(model)
    assert count == len(model.decoder.layers) * len(fp8_weights.PRODUCTS) + 1
    first = model.decoder.layers[0].self_attn.qkv_proj.rounded
    fp8_weights.attach(model)  # an engine sharing the model: the graphs of the first read these tensors
    assert model.decoder.layers[0].self_attn.qkv_proj.rounded is first
    assert torch.equal(model.decoder.lm_head.weight, lm_head)


def test_fp8_weights_do_not_combine_with_fp8_prefill():
    with pytest.raises(ValueError, match="fp8_weights and fp8_prefill"):
        EngineOptions(fp8_weights=True, fp8_prefill=True)
    assert EngineOptions(fp8_weights=True, kv_int8=True, fp8_encoder=True).fp8_weights


def test_fp8_weights_need_the_fused_kernels(tiny_model_dir):
    with pytest.raises(ValueError, match="FP8 decoder weights need the fused kernels"):
        Engine.from_pretrained(str(tiny_model_dir), device="cpu",
                               options=EngineOptions(num_slots=2, fused_kernels=False, fp8_weights=True))
