"""FP8 weights for the text decoder's large products (opt-in: EngineOptions.quantize, `--quantize fp8`).

Hopper has FP8 tensor cores: twice bf16's throughput and half its weight bytes. `quantize(model, mode)` swaps the
decoder's linear layers (qkv, o, gate_up, down; the output layer too in mode "fp8-lm-head") for `Fp8Linear`, whose
forward quantizes its input per token (dynamic: scale = the row's amax / 448, e4m3) and multiplies with
`torch._scaled_mm` against the weight quantized once per output channel (e4m3, float32 scales), output bfloat16.

Only where cuBLAS ran before: every `Fp8Linear` keeps its bfloat16 `weight`, which is what the decode step's small
buckets read (FusedLayerOps sends products of up to `gemv_rows` rows through gemv.py's kernels on `linear.weight`;
only larger ones call `linear(x)`), so those buckets compute exactly what they did without the swap. The encoder and
the embedding stay bfloat16.

`torch._scaled_mm` with row-wise scales (torch 2.11 on sm90, the H200's image; torch 2.13 on the CPU): mat1 [M, K]
row-major and mat2 [K, N] column-major, both float8_e4m3fn; K and N multiples of 16 (M any); scale_a [M, 1] and
scale_b [1, N], float32 and contiguous; out_dtype bfloat16. A layer whose K or N is not a multiple of 16 has its
quantized weight zero-padded to one (and its activations padded along K with zeros): zeros add nothing to a product.

The activation quantization is one Triton kernel on a GPU (PyTorch's ops would be ~8 launches per product, ~900 per
decode step at 28 layers) and the same arithmetic in PyTorch elsewhere. The kernel rounds to e4m3's grid itself
(round to nearest even, subnormals included) before the cast, so the cast is exact: a GPU's cvt and Triton's
interpreter, which rounds e4m3 wrongly, then agree with PyTorch's `.to(torch.float8_e4m3fn)` bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3fn value
MIN_SCALE = 1e-12  # a row of zeros (a padding row) gets this scale: its values stay 0, nothing divides by zero
ALIGN = 16  # _scaled_mm's K and N multiple
# What each mode of EngineOptions.quantize swaps: the decoder layers' four products, and with "-lm-head" the output
# layer too (its 151,936 x D weight is ~a quarter of the decoder's bytes, but its argmax decides every token)
MODES = {"fp8": False, "fp8-lm-head": True}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def quantize_rows(x: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, width] (zero-padded past K; width defaults to K), float32 scales [M, 1]) with
    x ~= q * scale row by row: scale = max(amax(|x_row|) / 448, MIN_SCALE)."""
    M, K = x.shape
    width = K if width is None else width
    if kernels.available(x.device) and M > 0:
        return _quantize_rows_triton(x, width)
    scale = (x.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=MIN_SCALE)
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return (F.pad(q.view(torch.uint8), (0, width - K)).view(E4M3) if width != K else q), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N', K'] row-major, float32 scales [1, N']): per output channel, N and K zero-padded
    to multiples of 16 (padded channels have scale 1 and weights 0)."""
    N, K = weight.shape
    n, k = _round_up(N, ALIGN), _round_up(K, ALIGN)
    scale = (weight.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=MIN_SCALE)
    q = (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    padded = torch.zeros((n, k), dtype=torch.uint8, device=weight.device)
    padded[:N, :K] = q.view(torch.uint8)
    scales = torch.ones((1, n), dtype=torch.float32, device=weight.device)
    scales[0, :N] = scale[:, 0]
    return padded.view(E4M3), scales


class Fp8Linear(nn.Linear):
    """An nn.Linear (no bias) that multiplies in FP8: x quantized per token, the weight per output channel.

    `weight` is still the bfloat16 Parameter it was built from (the same object: a tied output layer stays tied),
    for the GEMV kernels of small products; `weight_fp8` [N', K'] (row-major, so its .t() is the column-major mat2
    _scaled_mm takes) and `weight_scale` [1, N'] are non-persistent buffers (a state_dict is unchanged).
    """

    def __init__(self, linear: nn.Linear):
        if linear.bias is not None:
            raise ValueError("Fp8Linear takes a linear layer without bias (the decoder's have none)")
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a fresh weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", None)
        q, scale = quantize_weight(linear.weight.detach())
        self.register_buffer("weight_fp8", q, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] bfloat16 -> [..., N] bfloat16
        lead, K = x.shape[:-1], x.shape[-1]
        N, width = self.out_features, self.weight_fp8.shape[1]
        q, scale = quantize_rows(x.reshape(-1, K), width)
        out = torch._scaled_mm(q, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale,
                               out_dtype=torch.bfloat16)
        if out.shape[1] != N:
            out = out[:, :N].contiguous()
        return out.view(*lead, N)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3 (per token x per channel)"


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """RuntimeError saying why FP8 products cannot run here: a model that is not bfloat16, a CUDA GPU without FP8
    tensor cores (compute capability below 8.9), or a device where torch._scaled_mm fails on a 16 x 16 probe."""
    if dtype != torch.bfloat16:
        raise RuntimeError(f"FP8 quantization needs a bfloat16 model (--dtype bfloat16), this one is {dtype}")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < (8, 9):
            raise RuntimeError(f"FP8 quantization needs FP8 tensor cores (compute capability 8.9 or later: Ada, "
                               f"Hopper); {torch.cuda.get_device_name(index)} has {major}.{minor}")
    try:
        probe = Fp8Linear(nn.Linear(ALIGN, ALIGN, bias=False, device=device, dtype=dtype))
        probe(torch.ones((1, ALIGN), device=device, dtype=dtype))
    except Exception as e:  # noqa: BLE001 -- whatever torch raises, say where and why
        raise RuntimeError(f"FP8 quantization cannot run on {device} with torch {torch.__version__}: "
                           f"torch._scaled_mm failed ({type(e).__name__}: {e})") from e


def quantize(model, mode: str = "fp8") -> list[str]:
    """Swap `model.decoder`'s products for Fp8Linear in place (mode: a key of MODES) -> the names swapped.

    RuntimeError (check_supported) where FP8 cannot run; ValueError for an unknown mode. Call before an Engine is
    built on the model: its CUDA graphs capture whichever modules are there then."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}: use one of {', '.join(MODES)}")
    decoder = model.decoder
    weight = decoder.embed_tokens.weight
    check_supported(weight.device, weight.dtype)
    names = [f"layers.{i}.{p}" for i in range(len(decoder.layers)) for p in PROJECTIONS]
    if MODES[mode]:
        names.append("lm_head")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = decoder.get_submodule(parent_name) if parent_name else decoder
        linear = getattr(parent, child)
        if not isinstance(linear, Fp8Linear):
            setattr(parent, child, Fp8Linear(linear))
    return names


def quantized(model) -> list[str]:
    """The names (under model.decoder) of the products that multiply in FP8."""
    return [name for name, m in model.decoder.named_modules() if isinstance(m, Fp8Linear)]


# ----------------------------------------------------------------------------------------------------------------
# the activation quantization in one kernel


if kernels.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _round_to_e4m3(v):
        # v: float32 with |v| <= 448 -> the nearest e4m3 value (ties to even), still float32. Normal range: drop the
        # 20 low mantissa bits of 23 with round to nearest even (a carry moves into the exponent, as it must).
        # Below 2^-6 (e4m3's subnormals, a fixed step of 2^-9): add and take away 2^14, whose float32 ulp is 2^-9.
        # The sign bit is copied as it is (a negative value that rounds to zero is -0, as PyTorch's cast gives).
        bits = v.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 0xFFF00000
        a = tl.abs(v)
        sub = (a + 16384.0) - 16384.0
        sub = tl.where(bits < 0, -sub, sub)
        return tl.where(a < 0.015625, sub, normal)

    @triton.jit
    def _quantize_rows_kernel(X, Q, S, K, WIDTH, stride_x, min_scale, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # one row: scale = max(amax / 448, min_scale); Q[row, :K] = e4m3(x / scale), Q[row, K:WIDTH] = 0
        kernels._await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0), min_scale)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(Q + row * WIDTH + cols, _round_to_e4m3(v).to(tl.float8e4nv), mask=cols < WIDTH)
        tl.store(S + row, scale)


def _quantize_rows_triton(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((M, width), dtype=E4M3, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(width)
    _quantize_rows_kernel[(M,)](x, q, scale, K, width, x.stride(0), MIN_SCALE, BLOCK=block,
                                num_warps=min(16, max(1, block // 256)), **kernels.pdl_options(x.device, M))
    return q, scale
