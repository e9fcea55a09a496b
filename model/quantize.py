"""Opt-in int8 weight-only quantization of the text decoder's linear layers.

Per-output-channel symmetric int8 (scale = max |w| / 127 per row), dequantized on the fly (x @ w.T * scale): half
the weight bytes of bf16 for the memory-bound decode step. The embedding and the audio encoder stay in full precision;
the lm_head is quantized too (it is the largest matrix), except when it is tied to the embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype)) * self.scale

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scale.float()[:, None]


def quantize_decoder_int8(model) -> int:
    """Replace the decoder's projections (and an untied lm_head) with Int8Linear in place; returns how many."""
    decoder = model.decoder
    count = 0
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            setattr(owner, name, Int8Linear(getattr(owner, name)))
            count += 1
    if decoder.lm_head.weight is not decoder.embed_tokens.weight:
        decoder.lm_head = Int8Linear(decoder.lm_head)
        count += 1
    return count
