"""The lm_head's weight rounded to FP8 (opt-in: EngineOptions.fp8_lm_head, `--fp8-lm-head`), for batch-1 latency.

At one row the lm_head is the one product of the decode step at its bandwidth floor: 311 MB (0.6B) or 622 MB (1.7B)
of bf16 weight streamed a step, 103 us of a 0.88 ms step on an H100 (docs/benchmarks.md, session 38). Here its weight
is rounded to e4m3 with a power-of-two scale per output channel (vocabulary row), and the decode step's small lm_head
(gemv.py, up to 32 rows) streams those bytes: half of bf16's, 67 us at one row.

The layers' products were rounded the same way and measured (session 38): slower, every one but o_proj (gate_up 6.8
-> 10.4 us at one row). They are latency-bound, not byte-bound, and widening FP8 to bf16 on the way to the MMA costs
more than the bytes save; so only the lm_head is rounded.

Everything else multiplies the same numbers: the rounded weight keeps its `image`, values * scale in the model's
dtype, which holds them exactly (e4m3's 3-bit mantissas times a power of two), and cuBLAS's lm_head (the prefill's
first tokens past 32 sequences, decode steps of more rows) takes it. A power-of-two scale commutes with rounding, so
gemv.py's FP8 product is its bf16 product over the image bit for bit (on the H100 too, session 38): an engine with
the option is one model, whatever kernel runs a row. Tokens are not bf16's: docs/benchmarks.md has the agreement
measured. The embeddings stay as they are (a tied lm_head gets an image of its own); the model's own lm_head weight
too, which engines without the option (sharing the model) keep using.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


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


def attach(model) -> None:
    """Give the lm_head its RoundedWeight (attribute `rounded`), unless it has one: an engine that attaches again
    (sharing the model) keeps the tensors the CUDA graphs of the first read. The model's own weight is untouched."""
    lm_head = model.decoder.lm_head
    if getattr(lm_head, "rounded", None) is None:
        lm_head.rounded = round_weight(lm_head.weight)


def rounded_copy(model):
    """A copy of the model whose lm_head weight is its image (untied from the embeddings): the rounded model as plain
    weights, for references that run without the option (the eager path, tests)."""
    copy = deepcopy(model)
    lm_head = copy.decoder.lm_head
    lm_head.weight = nn.Parameter(round_weight(lm_head.weight).image, requires_grad=False)
    lm_head.rounded = None
    return copy
