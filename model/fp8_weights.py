"""The decoder's weights rounded to FP8 (opt-in: EngineOptions.fp8_weights, `--fp8-weights`), for batch-1 latency.

At one row a decode step streams every decoder weight once, and its products are the larger half of the step
(docs/benchmarks.md, session 15: 17.5 of a layer's 30 us, at 2.5x their bytes' time; the lm_head's 311 MB at its
floor). Each product's weight (qkv, o_proj, gate_up, down of every layer, and the lm_head) is rounded here to e4m3
with a power-of-two scale per output channel, and the decode step's small products (gemv.py, up to 32 rows) stream
those bytes: half of bf16's.

Everything else multiplies the same numbers: each rounded weight keeps its `image`, values * scale in the model's
dtype, which holds them exactly (e4m3's 3-bit mantissas times a power of two), and cuBLAS's products (the prefill,
decode steps of more rows) take it. A power-of-two scale commutes with rounding, so gemv.py's FP8 product is its bf16
product over the image bit for bit, and an engine with fp8_weights is one model, the rounded one, whatever kernel
runs a row. Tokens are not bf16's: docs/benchmarks.md has the agreement measured. The embeddings stay as they are
(a tied lm_head gets an image of its own). The memory cost: the values and the image beside the original weights,
which the engines without the option (sharing the model) keep using.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
PRODUCTS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")  # each decoder layer's


@dataclass(frozen=True)
class RoundedWeight:
    """A weight [N, K] in FP8: values e4m3 [N, K], scales float32 [N] (powers of two), and their exact product in the
    model's dtype, image [N, K] (what cuBLAS multiplies)."""

    values: torch.Tensor
    scales: torch.Tensor
    image: torch.Tensor


def round_weight(weight: torch.Tensor) -> RoundedWeight:
    """weight [N, K] -> its RoundedWeight: each row's scale the least power of two that brings the row within e4m3's
    range (an all-zero row: 1), its values rounded to nearest."""
    w = weight.detach().float()
    mantissa, exponent = torch.frexp(w.abs().amax(dim=1) / E4M3_MAX)  # amax / 448 = mantissa * 2^exponent, [0.5, 1)
    scales = torch.where(mantissa > 0, torch.ldexp(torch.ones_like(mantissa), exponent), 1.0)
    values = (w / scales[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)  # dividing by a power of two is exact
    return RoundedWeight(values, scales.contiguous(), (values.float() * scales[:, None]).to(weight.dtype))


def attach(model) -> int:
    """Give each decoder layer's PRODUCTS and the lm_head its RoundedWeight (attribute `rounded`), unless it has one
    -> the number of weights rounded. The model's own weights are untouched: engines without the option keep them,
    and one that attaches again keeps the rounded weights its CUDA graphs read."""
    products = [layer.get_submodule(name) for layer in model.decoder.layers for name in PRODUCTS]
    for product in products + [model.decoder.lm_head]:
        if getattr(product, "rounded", None) is None:
            product.rounded = round_weight(product.weight)
    return len(products) + 1


def rounded_copy(model):
    """A copy of the model whose products' weights are their images (the lm_head untied from the embeddings): the
    rounded model as plain weights, for references that run without the option (the eager path, tests)."""
    copy = deepcopy(model)
    for product in [layer.get_submodule(name) for layer in copy.decoder.layers for name in PRODUCTS] + \
            [copy.decoder.lm_head]:
        product.weight = nn.Parameter(round_weight(product.weight).image, requires_grad=False)
        product.rounded = None
    return copy
