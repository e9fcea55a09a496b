"""FP8 products for an admission's large matrices (opt-in: EngineOptions.fp8_admission, `--fp8-admission`).

An offline run at 512 rows spends about a third of the GPU's time in the admissions' cuBLAS products (the prefill's
and the encoder's, thousands of rows each, at two-thirds of bf16's peak: docs/benchmarks.md, session 22), and Hopper's
FP8 tensor cores have twice bf16's throughput. `quantize(model)` swaps the decoder layers' four products (qkv, o,
gate_up, down) and the audio encoder layers' six (q, k, v, out, fc1, fc2) for `Fp8Linear`, which multiplies products
of at least `min_rows` rows (tokens) in FP8: the input quantized per row (dynamic: scale = the row's amax / 448,
e4m3) and `torch._scaled_mm` against the weight quantized once per output channel (e4m3, float32 scales), output
bfloat16, the bias added in the product's epilogue. Smaller products (every decode step's: session 7 measured FP8
there and it was slower in every bucket, a quantization launch per product on latency-bound products) run on the
bfloat16 weight exactly as before: the decode buckets compute what they did without the swap, and the output layer
is never swapped.

Per-row scales keep a row's product independent of its batch mates, as every kernel here must (identical inputs give
identical rows). `torch._scaled_mm` with row-wise scales: mat1 [M, K] row-major and mat2 [K, N] column-major, both
float8_e4m3fn, K and N multiples of 16 (the real models' are; a layer whose are not stays bfloat16), scale_a [M, 1]
and scale_b [1, N] float32, out_dtype bfloat16.

The activation quantization is one Triton kernel on a GPU and the same arithmetic in PyTorch elsewhere. The kernel
rounds to e4m3's grid itself (round to nearest even, subnormals included) before the cast, so the cast is exact: a
GPU's conversion and Triton's interpreter, which rounds e4m3 wrongly, agree with PyTorch's `.to(torch.float8_e4m3fn)`
bit for bit.
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
# Products of fewer rows stay bfloat16: every decode step's (its buckets go up to the slots, 1,024 at most in the
# benches), the batch-1 clip's ~150 encoder and prefill tokens. An offline admission's prefill graphs run thousands.
MIN_ROWS = 2048
DECODER_PRODUCTS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
ENCODER_PRODUCTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) with x ~= q * scale row by row:
    scale = max(amax(|x_row|) / 448, MIN_SCALE)."""
    if kernels.available(x.device) and x.shape[0] > 0:
        return _quantize_rows_triton(x)
    scale = (x.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K] row-major, float32 scales [1, N]), per output channel."""
    scale = (weight.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=MIN_SCALE)
    q = (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.t().contiguous()


def supports(linear: nn.Linear) -> bool:
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


class Fp8Linear(nn.Linear):
    """An nn.Linear that multiplies products of at least `min_rows` rows in FP8 (x per row, the weight per channel).

    `weight` and `bias` are still the Parameters it was built from (a state_dict is unchanged): smaller products use
    them as nn.Linear does. `weight_fp8` [N, K] (row-major, so its .t() is the column-major mat2 _scaled_mm takes)
    and `weight_scale` [1, N] are non-persistent buffers.
    """

    def __init__(self, linear: nn.Linear, min_rows: int | None = None):
        if not supports(linear):
            raise ValueError(f"FP8 products need in and out features that are multiples of {ALIGN}, got "
                             f"{linear.in_features} -> {linear.out_features}")
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a fresh weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.min_rows = MIN_ROWS if min_rows is None else min_rows
        self.weight, self.bias = linear.weight, linear.bias
        q, scale = quantize_weight(linear.weight.detach())
        self.register_buffer("weight_fp8", q, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, K = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, K)
        if rows.shape[0] < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        q, scale = quantize_rows(rows)
        out = torch._scaled_mm(q, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale,
                               bias=None if self.bias is None else self.bias.detach(), out_dtype=torch.bfloat16)
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8 e4m3 from {self.min_rows} rows")


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """RuntimeError saying why FP8 products cannot run here: a model that is not bfloat16, a CUDA GPU without FP8
    tensor cores (compute capability below 8.9), or a device where torch._scaled_mm fails on a small probe."""
    if dtype != torch.bfloat16:
        raise RuntimeError(f"FP8 products need a bfloat16 model (--dtype bfloat16), this one is {dtype}")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < (8, 9):
            raise RuntimeError(f"FP8 products need FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper); "
                               f"{torch.cuda.get_device_name(index)} has {major}.{minor}")
    try:
        probe = Fp8Linear(nn.Linear(ALIGN, ALIGN, device=device, dtype=dtype), min_rows=1)
        probe(torch.ones((1, ALIGN), device=device, dtype=dtype))
    except Exception as e:  # noqa: BLE001 -- whatever torch raises, say where and why
        raise RuntimeError(f"FP8 products cannot run on {device} with torch {torch.__version__}: "
                           f"torch._scaled_mm failed ({type(e).__name__}: {e})") from e


def quantize(model, min_rows: int | None = None) -> list[str]:
    """Swap the decoder's and the audio encoder's products for Fp8Linear in place -> the names swapped.

    RuntimeError (check_supported) where FP8 cannot run. Call before an Engine is built on the model: its CUDA
    graphs capture whichever modules are there then."""
    weight = model.decoder.embed_tokens.weight
    check_supported(weight.device, weight.dtype)
    targets = [f"decoder.layers.{i}.{p}" for i in range(len(model.decoder.layers)) for p in DECODER_PRODUCTS]
    targets += [f"encoder.layers.{i}.{p}" for i in range(len(model.encoder.layers)) for p in ENCODER_PRODUCTS]
    swapped = []
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if isinstance(linear, Fp8Linear) or not supports(linear):
            continue
        setattr(parent, child, Fp8Linear(linear, min_rows))
        swapped.append(name)
    return swapped


def quantized(model) -> list[str]:
    """The names of the products that multiply in FP8 from their min_rows on."""
    return [name for name, m in model.named_modules() if isinstance(m, Fp8Linear)]


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
    def _quantize_rows_kernel(X, Q, S, K, stride_x, min_scale, BLOCK: tl.constexpr):
        # one row: scale = max(amax / 448, min_scale); Q[row] = e4m3(x / scale)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0), min_scale)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(Q + row * K + cols, _round_to_e4m3(v).to(tl.float8e4nv), mask=cols < K)
        tl.store(S + row, scale)


def _quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((M, K), dtype=E4M3, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(K)
    _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), MIN_SCALE, BLOCK=block,
                                num_warps=min(16, max(1, block // 256)))
    return q, scale
