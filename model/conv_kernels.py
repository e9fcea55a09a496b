"""The audio encoder's first convolution, its bias and its GELU in one Triton kernel, written channels-last (#16).

The conv front end turns each 1 s chunk of mel features [128 mels, 100 frames] into 13 tokens through three
3x3 stride-2 convolutions, each followed by GELU. The first has one input channel and 480 outputs, so its output is
the largest tensor of the encoder (64 x 50 positions x 480 channels a chunk: 3 MB in bf16), and in PyTorch it is
written and read four times: cuDNN's convolution (a non-tensor-core kernel, one input channel), the bias added by a
broadcasting kernel, the GELU, and cuDNN's conversion to channels-last for the second convolution's tensor-core kernel.
Here each output is 9 multiply-adds of the input, so one kernel computes it, adds the bias and applies GELU and
writes it once, channels-last, the layout the next convolution reads. On the H200 (docs/benchmarks.md, session 13) a
64-chunk conv graph took 1.61 ms with PyTorch's and 0.89 ms with this one (20 kernels -> 12), and offline throughput
rose 6.5% (three alternating runs each).

It rounds where the PyTorch path does (the convolution's output, the bias add and the GELU each to the activation
dtype), so the two differ only in the order of the 9-term sum. The tests run it through Triton's interpreter.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the encoder uses its PyTorch path
    triton = None

# a program's tile: output positions of one chunk x output channels (480 = 15 blocks of 32), and its warps. On the
# H200 at 64 chunks (`python -m qasr.bench.conv_front_end --conv1-tiles`, session 14) 128 x 32 x 4 took 0.228 ms,
# 64 x 64 x 4 0.262, 64 x 32 x 4 0.265, 256 x 32 x 8 0.263, 128 x 64 x 8 0.350 (every tile the same bits)
BLOCK_POSITIONS = 128
BLOCK_CHANNELS = 32
NUM_WARPS = 4

if triton is not None:

    @triton.jit
    def _conv1_gelu_kernel(X, W, B, Y, H, Wd, Ho, Wo, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        # X [N, H, Wd] one-channel images; W [C, 9] the 3x3 taps; B [C]; Y [N, Ho, Wo, C]: gelu(conv(x) + b),
        # 3x3, stride 2, zero padding 1, computed in float32 and rounded as the PyTorch path rounds
        n = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        p_ok = p < Ho * Wo
        c_ok = c < C
        i = p // Wo
        j = p % Wo
        acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
        for di in tl.static_range(3):
            for dj in tl.static_range(3):
                r = 2 * i + di - 1
                s = 2 * j + dj - 1
                inside = p_ok & (r >= 0) & (r < H) & (s >= 0) & (s < Wd)
                x = tl.load(X + n * H * Wd + r * Wd + s, mask=inside, other=0.0).to(tl.float32)
                w = tl.load(W + c * 9 + di * 3 + dj, mask=c_ok, other=0.0).to(tl.float32)
                acc += x[:, None] * w[None, :]
        dt = Y.dtype.element_ty
        b = tl.load(B + c, mask=c_ok, other=0.0).to(tl.float32)
        h = (acc.to(dt).to(tl.float32) + b[None, :]).to(dt).to(tl.float32)
        g = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
        tl.store(Y + (n * Ho * Wo + p)[:, None] * C + c[None, :], g.to(dt), mask=p_ok[:, None] & c_ok[None, :])


def conv1_gelu(chunks: torch.Tensor, conv: torch.nn.Conv2d, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """gelu(conv(chunks[:, None])) for the encoder's first convolution (one input channel, 3x3, stride 2, padding 1).

    chunks: contiguous [N, H, W] -> [N, C, ceil(H/2), ceil(W/2)] in channels-last memory (a permuted view of
    [N, H', W', C]), as F.gelu(conv(chunks.unsqueeze(1))) up to the order of the 9-term sums. tile: (positions,
    channels, warps) of a program (default the module's; each output's sum is the same whatever the tile).
    """
    block_p, block_c, warps = tile or (BLOCK_POSITIONS, BLOCK_CHANNELS, NUM_WARPS)
    weight, bias = conv.weight, conv.bias
    C = weight.shape[0]
    if weight.shape[1:] != (1, 3, 3) or conv.stride != (2, 2) or conv.padding != (1, 1) or bias is None:
        raise ValueError(f"conv1_gelu takes a 3x3 stride-2 padding-1 convolution of one input channel with a bias, "
                         f"got weight {tuple(weight.shape)}, stride {conv.stride}, padding {conv.padding}")
    N, H, Wd = chunks.shape
    assert chunks.is_contiguous() and chunks.dtype == weight.dtype
    Ho, Wo = (H + 1) // 2, (Wd + 1) // 2
    out = torch.empty((N, Ho, Wo, C), dtype=chunks.dtype, device=chunks.device)
    grid = (N, triton.cdiv(Ho * Wo, block_p), triton.cdiv(C, block_c))
    _conv1_gelu_kernel[grid](chunks, weight.reshape(C, 9), bias, out, H, Wd, Ho, Wo, C,
                             BLOCK_P=block_p, BLOCK_C=block_c, num_warps=warps)
    return out.permute(0, 3, 1, 2)
