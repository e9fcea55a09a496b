"""Matrix products of the decode step's few rows: weight-streaming GEMV / skinny GEMM kernels in Triton.

At decode a layer multiplies 1..32 rows by weights of 4-12 MB. cuBLAS picks kernels built for large products, which
take 5-10 us where the weight bytes need 1-3 us at the H200's bandwidth (docs/benchmarks.md). Here a program owns
BLOCK_N output columns of up to 16 rows (and, where N alone gives too few programs, 1/SPLIT of the reduction): it
streams its weight tile once and multiplies on tensor cores with the weight tile as the MMA's long side ("swap AB"),
accumulating in float32.

Split-K partial sums are not reduced here (that would be one more launch): `partial_products` returns them as float32
[S, M, N] and the kernel that consumes the product (add+RMSNorm, q/k-norm+RoPE in kernels.py) sums them in a fixed
order and rounds to the activation dtype, as nn.Linear's output would be rounded.

FP8 weights (model/fp8_lm_head.py): _gemv_kernel's weight may be e4m3 with a float32 power-of-two scale per output
column. It widens the bytes to the activations' dtype on the way to the MMA and scales each column's sums at the end.
A power-of-two scale commutes with every rounding, so the result is that of the same kernel over the bf16 weight
`values * scale`, bit for bit (in Triton's interpreter and on an H100), in half the weight bytes. (gate_up_silu took
FP8 weights too in session 38: slower, and not bit for bit on the H100; removed.)

The lm_head's product can also take each row's argmax (linear_argmax): every program leaves its column block's
largest logit and that logit's first column, and kernels.advance_rows reduces those in the launch it makes anyway.

Row independence: a row's result depends only on its own input and on the config, and the config is chosen per weight
shape (N, K), never per batch, so every bucket up to `max_rows()` runs the same reduction order: a row gets the same
bits whatever its batch mates and its bucket. More than 16 rows are more programs over the same 16-row tile.

These kernels take part in programmatic dependent launch as kernels.py's do (on by default, $QASR_PDL=0 turns it
off; see its docstring): each program waits for the kernel before it before its first load.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import torch

from . import gpu_timing, kernels

triton, tl = kernels.triton, (kernels.tl if kernels.triton is not None else None)

log = logging.getLogger(__name__)

BLOCK_M = 16  # rows per tile: the smallest MMA side, padded with masked rows
MULTI_TILE_STAGES = 3  # the most loads in flight per program once the rows take more than one tile (GemvConfig.stages)
DEFAULT_MAX_ROWS = 32
MAX_ROWS_ENV = "QASR_DECODE_GEMV"  # rows up to which the decode step's products use these kernels; 0: cuBLAS only
TUNE_ENV = "QASR_GEMV_TUNE"  # "0": take each shape's heuristic config instead of timing a few at first use


def max_rows() -> int:
    """Rows up to which products stream their weights through these kernels ($QASR_DECODE_GEMV, default 32)."""
    value = os.environ.get(MAX_ROWS_ENV, str(DEFAULT_MAX_ROWS))
    if not value.isdigit():
        raise ValueError(f"{MAX_ROWS_ENV} must be a whole number of rows (0: off), got {value!r}")
    return int(value)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program (the MMA's long side: 16 or more)
    block_k: int  # reduction step
    split: int = 1  # programs sharing one column block's reduction (partial sums)
    num_warps: int = 4
    num_stages: int = 4  # loads in flight per program when the rows fit one tile (the rows the tuner times)

    def stages(self, M: int) -> int:
        """Loads in flight per program for M rows. Past one row tile the launch has twice the programs or more, and
        a 4-deep ring of shared memory each likely leaves too few of them resident per SM. H200, 0.6B step (session
        19): 4 stages everywhere took 1 row from 0.826 to 0.796 ms but 32 rows from 1.155 to 1.19; this rule 0.784
        and 1.122 (3 stages: 0.820, 1.155)."""
        return self.num_stages if M <= BLOCK_M else min(self.num_stages, MULTI_TILE_STAGES)

    def k_per_split(self, K: int) -> int:
        return -(-(-(-K // self.split)) // self.block_k) * self.block_k

    def splits(self, K: int) -> int:
        """Partial sums actually made: the reduction is cut into k_per_split(K)-wide pieces."""
        return -(-K // self.k_per_split(K))


if triton is not None:

    _await_inputs = kernels._await_inputs

    @triton.jit
    def _block_argmax(v, rows, rmask, cols, cmask, MAX_V, MAX_I):
        # v: [BLOCK_N, BLOCK_M] this program's rounded products as float32; per row, MAX_V/MAX_I [M, column blocks]
        # at this column block take its largest value and that value's first column (NaN and the first NaN's column
        # where there is one), for kernels.advance_rows to finish the argmax (kernels.BlockMaxima)
        big = 2147483647  # int32 max: "no column"
        v = tl.where(cmask[:, None], v, float("-inf"))
        is_nan = v != v
        nan_col = tl.min(tl.where(is_nan, cols[:, None], big), axis=0)
        v = tl.where(is_nan, float("-inf"), v)
        top = tl.max(v, axis=0)
        first = tl.min(tl.where(cmask[:, None] & (v == top[None, :]), cols[:, None], big), axis=0)
        has_nan = nan_col < big
        at = rows.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        tl.store(MAX_V + at, tl.where(has_nan, float("nan"), top), mask=rmask)
        tl.store(MAX_I + at, tl.where(has_nan, nan_col, first), mask=rmask)

    @triton.jit
    def _gemv_kernel(X, W, SCALE, OUT, MAX_V, MAX_I, M, N, K, stride_xm, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, ARGMAX: tl.constexpr,
                     SCALED: tl.constexpr, PDL: tl.constexpr):
        # program (row tile, column block, split): OUT[split, m, n] = sum over this split's k of X[m, k] W[n, k]
        # (OUT float32 partials) or, with one split, the product rounded to OUT's dtype; with ARGMAX (one split)
        # also each row's largest product of the block and its column (_block_argmax); SCALED: W is FP8, its
        # column n scaled by SCALE[n]
        _await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        rmask, cmask = rows < M, cols < N
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        k_start = split * K_SPLIT
        for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            w = tl.load(W + cols[:, None].to(tl.int64) * K + k[None, :], mask=cmask[:, None] & kmask[None, :],
                        other=0.0).to(X.dtype.element_ty)  # FP8 bytes widened (exactly) for the MMA
            x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        if SCALED:  # the column sums times their power-of-two scales (exact: see the module's docstring)
            acc = acc * tl.load(SCALE + cols, mask=cmask, other=1.0)[:, None]
        out = OUT + split.to(tl.int64) * M * N + rows[None, :] * N + cols[:, None]
        rounded = acc.to(OUT.dtype.element_ty)
        tl.store(out, rounded, mask=cmask[:, None] & rmask[None, :])
        if ARGMAX:
            _block_argmax(rounded.to(tl.float32), rows, rmask, cols, cmask, MAX_V, MAX_I)

    @triton.jit
    def _gate_up_silu_kernel(X, W, OUT, M, I, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
        # program (row tile, column block): OUT[m, n] = silu(gate) * up for gate = X W[n].T and up = X W[I + n].T,
        # each rounded where F.silu(gate) * up of nn.Linear's outputs rounds (as kernels.silu_mul does)
        _await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, cmask = rows < M, cols < I
        gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            wmask = cmask[:, None] & kmask[None, :]
            at = cols[:, None].to(tl.int64) * K + k[None, :]
            x = tl.trans(tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=rmask[:, None] & kmask[None, :],
                                 other=0.0))
            gate = tl.dot(tl.load(W + at, mask=wmask, other=0.0), x, gate, input_precision=PRECISION)
            up = tl.dot(tl.load(W + I * K + at, mask=wmask, other=0.0), x, up, input_precision=PRECISION)
        dt = OUT.dtype.element_ty
        g = gate.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        out = (act * up.to(dt).to(tl.float32)).to(dt)
        tl.store(OUT + rows[None, :] * I + cols[:, None], out, mask=cmask[:, None] & rmask[None, :])


E4M3 = torch.float8_e4m3fn  # an FP8 weight's dtype (model/fp8_lm_head.py)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether these kernels can multiply x [M, K] by weight [N, K] (2-D, of x's dtype or FP8, on a device the kernels
    run on)."""
    return (kernels.available(x.device) and x.dim() == 2 and weight.dim() == 2 and weight.dtype in (x.dtype, E4M3)
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and weight.is_contiguous())


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> None:
    if not supports(x, weight) or x.shape[1] != weight.shape[1] or x.stride(1) != 1:
        raise ValueError(f"gemv needs x [M, K] (unit stride along K) and a contiguous weight [N, K] of its dtype or "
                         f"FP8 on a device the kernels run on; got x {tuple(x.shape)} {x.dtype} {x.device}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if (weight.dtype == E4M3) != (scale is not None):
        raise ValueError("an FP8 weight needs its scales (float32 [N]), and only an FP8 weight takes them")
    if scale is not None and (scale.dtype != torch.float32 or scale.shape != weight.shape[:1]
                              or not scale.is_contiguous()):
        raise ValueError(f"an FP8 weight [N, K] takes contiguous float32 scales [N]; got {scale.dtype} "
                         f"{tuple(scale.shape)} for a weight {tuple(weight.shape)}")


def _precision(x: torch.Tensor) -> str | None:
    return "ieee" if x.dtype == torch.float32 else None  # float32 products exact, as F.linear's (not tf32)


def _row_tiles(M: int) -> int:
    return -(-M // BLOCK_M)


def partial_products(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None,
                     scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T as float32 partial sums [S, M, N] (S = the shape's split, often 1): their sum in
    order, rounded to x's dtype, is the product. kernels.rms_norm and kernels.qk_norm_rope_store take them.
    scale: an FP8 weight's per-column scales (float32 [N]; every function here takes them the same way)."""
    _check(x, weight, scale)
    M, K = x.shape
    N = weight.shape[0]
    config = config or config_for("products", N, K, x, weight.dtype)
    out = torch.empty((config.splits(K), M, N), dtype=torch.float32, device=x.device)
    _launch_products(x, weight, scale, out, config)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in x's dtype (no split: for products nothing fuses the sums into)."""
    config, out = _unsplit(x, weight, scale, config, "linear")
    _launch_products(x, weight, scale, out, config)
    return out


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None,
                  scale: torch.Tensor | None = None) -> tuple[torch.Tensor, kernels.BlockMaxima]:
    """linear(x, weight) and, from the same launch, each row's largest product per block of output columns with its
    first column (kernels.BlockMaxima [M, column blocks]): the lm_head's logits and what kernels.advance_rows needs
    to take their argmax, as torch.argmax would, without a launch of its own. The logits are linear's, bit for bit
    (the same config: the argmax only adds to the kernel's end)."""
    config, out = _unsplit(x, weight, scale, config, "linear_argmax")
    M, N = out.shape
    blocks = triton.cdiv(N, config.block_n)
    maxima = kernels.BlockMaxima(torch.empty((M, blocks), dtype=torch.float32, device=x.device),
                                 torch.empty((M, blocks), dtype=torch.int32, device=x.device))
    _launch_products(x, weight, scale, out, config, maxima)
    return out, maxima


def _unsplit(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, config: GemvConfig | None,
             caller: str) -> tuple[GemvConfig, torch.Tensor]:
    """linear's and linear_argmax's config (unsplit) and output [M, N] in x's dtype."""
    _check(x, weight, scale)
    M, K = x.shape
    N = weight.shape[0]
    config = config or config_for("linear", N, K, x, weight.dtype)
    if config.splits(K) != 1:
        raise ValueError(f"{caller} takes an unsplit config, got {config}")
    return config, torch.empty((M, N), dtype=x.dtype, device=x.device)


def _launch_products(x, weight, scale, out, config: GemvConfig, maxima: kernels.BlockMaxima | None = None) -> None:
    M, K = x.shape
    N = weight.shape[0]
    grid = (_row_tiles(M), triton.cdiv(N, config.block_n), config.splits(K))
    max_v, max_i = (maxima.values, maxima.index) if maxima is not None else (out, out)
    _gemv_kernel[grid](x, weight, scale if scale is not None else out, out, max_v, max_i, M, N, K, x.stride(0),
                       K_SPLIT=config.k_per_split(K), BLOCK_M=BLOCK_M, BLOCK_N=config.block_n,
                       BLOCK_K=config.block_k, PRECISION=_precision(x), ARGMAX=maxima is not None,
                       SCALED=scale is not None, num_warps=config.num_warps, num_stages=config.stages(M),
                       **kernels.pdl_options(x.device, M))


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """The MLP's first half in one kernel: x [M, K], gate|up weight [2I, K] (of x's dtype) -> silu(x gate.T) * (x
    up.T) [M, I]."""
    _check(x, weight, None)
    if weight.dtype != x.dtype:
        raise ValueError(f"gate_up_silu takes a weight of x's dtype ({x.dtype}), got {weight.dtype}")
    M, K = x.shape
    I = weight.shape[0] // 2
    if weight.shape[0] != 2 * I:
        raise ValueError(f"gate|up weight needs an even number of rows, got {tuple(weight.shape)}")
    config = config or config_for("gate_up_silu", I, K, x)
    out = torch.empty((M, I), dtype=x.dtype, device=x.device)
    grid = (_row_tiles(M), triton.cdiv(I, config.block_n))
    _gate_up_silu_kernel[grid](x, weight, out, M, I, K, x.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=config.block_n,
                               BLOCK_K=config.block_k, PRECISION=_precision(x), num_warps=config.num_warps,
                               num_stages=config.stages(M), **kernels.pdl_options(x.device, M))
    return out


# -- configs: one per (kind, N, K, dtype, weight dtype, device), chosen at first use, never inside a graph capture --

KINDS = ("products", "linear", "gate_up_silu")
_chosen: dict[tuple, GemvConfig] = {}


def _pow2_at_most(n: int, cap: int) -> int:
    p = 16
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def _split_for(N: int, K: int, block_n: int, block_k: int, programs: int) -> int:
    """The fewest splits (a power of two) that give ~`programs` programs, each still a whole block_k of reduction."""
    split = 1
    while -(-N // block_n) * split * 2 <= programs and K // (split * 2) >= block_k:
        split *= 2
    return split


def candidates(kind: str, N: int, K: int, device: torch.device, fp8: bool = False) -> list[GemvConfig]:
    """The few configs tried for a shape; the first is the heuristic one. In the CPU interpreter a program is a
    Python call: there the blocks are as large as the shape, so tests of real-vocabulary heads stay fast.
    fp8: for an FP8 weight, each config also with twice the reduction step (the same bytes a load as bf16's)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if device.type != "cuda":
        return [GemvConfig(block_n=_pow2_at_most(N, 4096), block_k=_pow2_at_most(K, 256))]
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    out = []
    widths = (64, 128, 32) if kind == "linear" else (64, 32, 128) if kind == "products" else (32, 16, 64)
    steps = (_pow2_at_most(K, 128), _pow2_at_most(K, 256)) if fp8 else (_pow2_at_most(K, 128),)
    for block_k in dict.fromkeys(steps):
        for block_n in widths:
            if kind == "products":
                split = _split_for(N, K, block_n, block_k, programs)
                out += [GemvConfig(block_n, block_k, s) for s in dict.fromkeys((split, max(1, split // 2),
                                                                                max(1, split // 4)))]
            else:
                out.append(GemvConfig(block_n, block_k))
    return out


def config_for(kind: str, N: int, K: int, x: torch.Tensor, weight_dtype: torch.dtype | None = None) -> GemvConfig:
    """The config of this shape: on CUDA, among the `candidates` within TIE_MARGIN of the fastest at 1 and 16 rows,
    the one with the fewest splits (`settle`; timed once, outside graph capture, in a CUDA graph as the decode step
    runs them; $QASR_GEMV_TUNE=0 takes the heuristic one), elsewhere the heuristic one. weight_dtype: x's unless
    given (E4M3: an FP8 weight)."""
    weight_dtype = weight_dtype or x.dtype
    key = (kind, N, K, x.dtype, weight_dtype, x.device)
    if key not in _chosen:
        options = candidates(kind, N, K, x.device, fp8=weight_dtype == E4M3)
        tune = (x.device.type == "cuda" and len(options) > 1 and os.environ.get(TUNE_ENV, "1") != "0"
                and not torch.cuda.is_current_stream_capturing())
        _chosen[key] = _fastest(kind, N, K, x, weight_dtype, options) if tune else options[0]
    return _chosen[key]


# Weight bytes the tuner cycles through: more than the GPU's L2 (50 MB on an H100 or H200), so each launch streams
# its weight from memory as a step's does (each layer has its own weights) instead of finding it in L2.
TUNE_WEIGHT_BYTES = 128 << 20


def _fastest(kind: str, N: int, K: int, x: torch.Tensor, weight_dtype: torch.dtype,
             options: list[GemvConfig]) -> GemvConfig:
    t0 = time.perf_counter()
    rows = 2 * N if kind == "gate_up_silu" else N
    copies = max(1, min(16, -(-TUNE_WEIGHT_BYTES // (rows * K * weight_dtype.itemsize))))
    weights = [torch.randn(rows, K, device=x.device, dtype=x.dtype).to(weight_dtype) for _ in range(copies)]
    inputs = [torch.randn(M, K, device=x.device, dtype=x.dtype) for M in (1, BLOCK_M)]
    run = {"products": partial_products, "linear": linear, "gate_up_silu": gate_up_silu}[kind]
    scaled = {"scale": torch.ones(rows, device=x.device)} if weight_dtype == E4M3 else {}
    timed = {config: sum(gpu_timing.per_call_ms([functools.partial(run, xs, w, config, **scaled) for w in weights],
                                                runs=5)
                         for xs in inputs) for config in options}
    best = settle(timed)
    log.info("gemv %s N=%d K=%d %s: %s (%s ms at 1 + %d rows; tried %d configs in %.1f s)", kind, N, K,
             str(weight_dtype).removeprefix("torch."), best, f"{timed[best]:.4f}", BLOCK_M, len(options),
             time.perf_counter() - t0)
    return best


TIE_MARGIN = 0.03  # configs this close to the fastest count as tied


def settle(timed: dict[GemvConfig, float]) -> GemvConfig:
    """Among the configs within TIE_MARGIN of the fastest, the one with the fewest splits, then the first in candidate
    order. A near-tie goes to the same config whichever of the two the timing noise favoured (on the H200 the qkv and
    lm_head picks flipped between two configs from one process to the next, session 15), so one build's step is the
    same kernels from one run to the next unless the noise is larger than the margin. Fewest splits, because the
    tuner times one row tile: more splits tie there but cost past it (H100, session 29: with the first tied config
    o_proj took split 16 in 7 runs of 10, 1.291-1.298 ms a step at 32 rows; with this rule 8 in 9 of 10, 1.232-1.237,
    and no bucket slower)."""
    fastest = min(timed.values())
    tied = [config for config, ms in timed.items() if ms <= fastest * (1 + TIE_MARGIN)]
    return min(tied, key=lambda config: config.split)  # min keeps the first of equal splits


def chosen_configs() -> dict[str, str]:
    """What has been chosen so far, for benchmark reports."""
    return {f"{kind} N={N} K={K} {str(dtype).removeprefix('torch.')}"
            + (" fp8 weight" if weight_dtype == E4M3 else ""): str(c)
            for (kind, N, K, dtype, weight_dtype, _), c in _chosen.items()}


def forget_configs() -> None:
    """Choose again at next use (tests; a benchmark comparing settings)."""
    _chosen.clear()

