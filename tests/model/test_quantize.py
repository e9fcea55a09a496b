"""Opt-in int8 weight-only decoder: faithful weights, a working engine, and how far transcripts move."""

import numpy as np
import torch

from qasr.model.checkpoint import load_model
from qasr.model.quantize import Int8Linear, quantize_decoder_int8
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest


def test_int8_linear_reconstructs_each_row_within_half_a_step():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    q = Int8Linear(lin)
    assert q.weight.dtype == torch.int8
    step = lin.weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantized() - lin.weight).abs() <= step / 2 + 1e-7).all()
    x = torch.randn(5, 64)
    assert torch.allclose(q(x), x @ q.dequantized().T, atol=1e-5)


def test_quantized_engine_transcribes_and_mostly_agrees(tiny_model_dir):
    model = load_model(tiny_model_dir)
    assert quantize_decoder_int8(model) == 4 * model.cfg.text.num_hidden_layers + 1  # + the untied lm_head
    assert isinstance(model.decoder.layers[0].mlp.down_proj, Int8Linear)
    opts = EngineOptions(num_slots=8, max_len=512, num_retained=0, quantize="int8")
    q = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=opts)
    ref = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(num_slots=8, max_len=512))
    rng = np.random.default_rng(0)
    clips = [(0.2 * rng.standard_normal(int(16000 * s))).astype(np.float32) for s in (1.0, 2.5, 4.0, 6.5, 9.0, 12.0)]
    reqs = [DecodeRequest(audio=c, max_new_tokens=24) for c in clips]
    a, b = ref.transcribe(reqs), q.transcribe(reqs)
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra.token_ids, rb.token_ids))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(ra.token_ids, rb.token_ids)) if x != y), 24)
                 for ra, rb in zip(a, b))
    total = sum(len(r.token_ids) for r in a)
    assert all(len(r.token_ids) == 24 for r in b)
    # measured 78/144 (0.54): random tiny logits lead by ~3%, so int8 flips some
    assert same / total >= 0.4, (f"int8 vs fp32, tiny model: {same}/{total} tokens equal position-wise, "
                                 f"{prefix}/{total} before the first difference")
