"""FP8 products in the decoder's prefill (opt-in: EngineOptions.fp8_prefill, `--fp8-prefill`).

An offline run spends about a quarter of the GPU's time in the admissions' cuBLAS products (docs/benchmarks.md,
session 22: 628 ms of 2.71 s at 512 rows, at two-thirds of bf16's peak), three quarters of their FLOPs the decoder's
prefill, and Hopper's FP8 tensor cores have twice bf16's throughput. Session 24 measured FP8 products there with a
separate quantization pass before each: the products alone took 0.58-0.80x bf16's time, the passes (each reading
and writing the activations at the bandwidth) brought that to 0.78-1.47x, and offline throughput fell 3%. Here the
activations come out of the kernel before the product already quantized: the RMSNorms that feed qkv and gate_up and
the SiLU*mul that feeds down write e4m3 rows and their scales (kernels.rms_norm / silu_mul with fp8=True), in fewer
bytes than the bfloat16 rows they wrote before, so the only extra work is the products' FP8 weights beside the bf16
ones. o_proj (its input is the attention's output) stays bfloat16. The audio encoder's products can go the same way
(EngineOptions.fp8_encoder, attach_encoder): q/k/v and fc1 fed by its LayerNorms, fc2 by its GELU, those kernels
quantizing (kernels.layer_norm / gelu with fp8=True); out_proj stays bfloat16.

Every prefill takes them (the runner's prefill ops), whatever its size, so a clip's tokens do not depend on how many
clips were admitted beside it; every decode step computes exactly what it did without FP8.

Formats: an activation row x is stored as e4m3(x * (1 / s)), s = max(amax(|x|) * (1 / 448), MIN_SCALE) in float32,
one scale a row (a row's product then does not depend on its batch mates, as every kernel here must not); a weight as
e4m3 per output channel the same way, its scales [1, N]. `torch._scaled_mm` takes both (row-wise scales) and writes
bfloat16. Reciprocals, not divisions: PyTorch on CUDA divides by a number by multiplying with its reciprocal (with
divisions, the kernels' scales matched it in 44% of rows on an H100), so this reads the same on every device, and a
kernel divides once a row instead of once an element (the quantizing SiLU*mul 1.34x -> 1.02x the bf16 one's time).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3fn value
MIN_SCALE = 1e-12  # a row of zeros (a padding row) gets this scale: its values stay 0, nothing divides by zero
ALIGN = 16  # _scaled_mm's K and N multiple (the real models' widths are)
PRODUCTS = ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj")  # each decoder layer's, fed by a quantizing
# kernel: the input RMSNorm, the post-attention RMSNorm, the SiLU*mul
ENCODER_PRODUCTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1", "fc2")  # each audio encoder
# layer's: q/k/v and fc1 fed by its LayerNorms, fc2 by the GELU (out_proj's input, the attention's, stays bfloat16)


class Rows(NamedTuple):
    """Activation rows in FP8: values e4m3 [N, K] and their float32 scales [N, 1] (values * scales ~ the rows)."""
    values: torch.Tensor
    scales: torch.Tensor


def quantize_rows(x: torch.Tensor) -> Rows:
    """x [N, K] -> its Rows, in PyTorch: what kernels.rms_norm and silu_mul write with fp8=True, bit for bit."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() * (1 / E4M3_MAX)).clamp(min=MIN_SCALE)
    return Rows((x.float() * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K] row-major, float32 scales [1, N]), per output channel."""
    q = quantize_rows(weight.detach())
    return q.values, q.scales.t().contiguous()


def linear(x: Rows, layer: nn.Linear) -> torch.Tensor:
    """x @ layer.weight.T in FP8 (the layer's weight as `attach` quantized it) -> [N, out] in the weight's dtype."""
    return torch._scaled_mm(x.values, layer.weight_fp8.t(), scale_a=x.scales, scale_b=layer.weight_scale,
                            bias=layer.bias, out_dtype=layer.weight.dtype)


def attach(model) -> int:
    """Give each decoder layer's PRODUCTS FP8 weights (non-persistent buffers `weight_fp8`, `weight_scale` beside the
    bf16 weight, which the decode steps keep using) and mark the RMSNorms before them to quantize their output (the
    fused ops with fp8_products then do) -> the number of products. RuntimeError where FP8 cannot run.
    A model attached before keeps its FP8 weights: engines sharing one model (bench/engine_ab) captured CUDA graphs
    that read them, and new buffers would free the ones those graphs hold."""
    weight = model.decoder.embed_tokens.weight
    check_supported(weight.device, weight.dtype)
    for layer in model.decoder.layers:
        for name in PRODUCTS:
            _quantize_once(layer.get_submodule(name), name)
        layer.input_layernorm.feeds_fp8 = layer.post_attention_layernorm.feeds_fp8 = True
    return len(model.decoder.layers) * len(PRODUCTS)


def attach_encoder(model) -> int:
    """Give each audio encoder layer's ENCODER_PRODUCTS FP8 weights as `attach` gives the decoder's (their biases
    stay bfloat16: the product adds them) -> the number of products. The encoder runs them when asked
    (encode_windows(fp8_products=True)), its LayerNorms and GELU quantizing their inputs. RuntimeError where FP8
    cannot run."""
    weight = model.decoder.embed_tokens.weight
    check_supported(weight.device, weight.dtype)
    for layer in model.encoder.layers:
        for name in ENCODER_PRODUCTS:
            _quantize_once(layer.get_submodule(name), name)
    return len(model.encoder.layers) * len(ENCODER_PRODUCTS)


def _quantize_once(product: nn.Linear, name: str) -> None:
    """`product`'s FP8 weight buffers, unless it has them (see attach)."""
    if product.in_features % ALIGN or product.out_features % ALIGN:
        raise RuntimeError(f"FP8 products need widths that are multiples of {ALIGN}, got {name} "
                           f"{product.in_features} -> {product.out_features}")
    if hasattr(product, "weight_fp8"):
        return
    q, scale = quantize_weight(product.weight)
    product.register_buffer("weight_fp8", q, persistent=False)
    product.register_buffer("weight_scale", scale, persistent=False)


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """RuntimeError saying why FP8 products cannot run here: a model that is neither bfloat16 (what they are for) nor
    float32 (the CPU tests'), a CUDA GPU without FP8 tensor cores (compute capability below 8.9), or torch._scaled_mm
    failing on a small probe."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise RuntimeError(f"FP8 products need a bfloat16 model (--dtype bfloat16), this one is {dtype}")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < (8, 9):
            raise RuntimeError(f"FP8 products need FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper); "
                               f"{torch.cuda.get_device_name(index)} has {major}.{minor}")
    try:
        probe = nn.Linear(ALIGN, ALIGN, bias=False, device=device, dtype=dtype)
        probe.weight_fp8, probe.weight_scale = quantize_weight(probe.weight)
        linear(quantize_rows(torch.ones((1, ALIGN), device=device, dtype=dtype)), probe)
    except Exception as e:  # noqa: BLE001 -- whatever torch raises, say where and why
        raise RuntimeError(f"FP8 products cannot run on {device} with torch {torch.__version__}: "
                           f"torch._scaled_mm failed ({type(e).__name__}: {e})") from e
