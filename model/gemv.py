"""Matrix products of the decode step's rows: weight-streaming GEMV / skinny GEMM kernels in Triton.

At decode a layer multiplies 1..256 rows by weights of 4-12 MB. cuBLAS picks kernels built for large products, which
take 5-10 us where the weight bytes need 1-3 us at the H200's bandwidth (docs/benchmarks.md), and at 64-256 rows
leave most SMs idle (o_proj at 256 rows is 16 of cuBLAS's 128x128 tiles for 132 SMs). Here a program owns BLOCK_N
output columns of BLOCK_M rows (and, where the tiles alone give too few programs, 1/SPLIT of the reduction): it
streams its weight tile once and multiplies on tensor cores, accumulating in float32. Up to 32 rows the tile is 16
rows with the weight tile as the MMA's long side ("swap AB"); above, the config of the row class (64, 128, 256 rows)
says the tile (32-128 rows, either orientation). The programs of one column block's row tiles run side by side, so
its weights come from DRAM once and from L2 for the others.

Split-K partial sums are not reduced here (that would be one more launch): `partial_products` returns them as float32
[S, M, N] and the kernel that consumes the product (add+RMSNorm, q/k-norm+RoPE in kernels.py) sums them in a fixed
order and rounds to the activation dtype, as nn.Linear's output would be rounded. Where a row class above 32 rows
does not split, `product` hands over the rounded product itself ([M, N] in x's dtype: the same bits, half the bytes).

The lm_head's product can also take each row's argmax (linear_argmax): every program leaves its column block's
largest logit and that logit's first column, and kernels.advance_rows reduces those in the launch it makes anyway.

Row independence: a row's result depends only on its own input and on the config, and the config is chosen per
weight shape (N, K) and row class, never per batch. The row class is fixed per CUDA-graph bucket (`row_class`: every
bucket up to 32 rows is one class; 64, 128 and 256 are one each, and larger buckets take 256's config), and a bucket's
graph always runs its full row count, padding rows included. So inside a class every row runs the same reduction
order: a row gets the same bits whatever its batch mates, and up to 32 rows whatever its bucket too; between classes
above 32 rows (as between cuBLAS's kernels there before) its bits may differ by rounding. More rows are more programs
over the same tile.

These kernels take part in programmatic dependent launch as kernels.py's do (on by default, $QASR_PDL=0 turns it
off; see its docstring): each program waits for the kernel before it before its first load.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from . import kernels

triton, tl = kernels.triton, (kernels.tl if kernels.triton is not None else None)

log = logging.getLogger(__name__)

BLOCK_M = 16  # rows per tile up to SMALL_ROWS: the smallest MMA side, padded with masked rows
SMALL_ROWS = 32  # the row class of every bucket up to 32 rows: 16-row tiles, the weights as the MMA's long side
ROW_CLASSES = (SMALL_ROWS, 64, 128, 256)  # configs are chosen per weight shape and one of these (row_class)
DEFAULT_MAX_ROWS = 32
MAX_ROWS_ENV = "QASR_DECODE_GEMV"  # rows up to which the decode step's products use these kernels; 0: cuBLAS only
TUNE_ENV = "QASR_GEMV_TUNE"  # "0": take each shape's heuristic config instead of timing a few at first use


def max_rows() -> int:
    """Rows up to which products stream their weights through these kernels ($QASR_DECODE_GEMV, default 32)."""
    value = os.environ.get(MAX_ROWS_ENV, str(DEFAULT_MAX_ROWS))
    if not value.isdigit():
        raise ValueError(f"{MAX_ROWS_ENV} must be a whole number of rows (0: off), got {value!r}")
    return int(value)


def row_class(rows: int) -> int:
    """The row class of a product over `rows` rows: the smallest of ROW_CLASSES that holds them (the largest past
    it). A decode bucket's graph always runs the bucket's rows, so its class, and with it every config, is fixed."""
    for size in ROW_CLASSES:
        if rows <= size:
            return size
    return ROW_CLASSES[-1]


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program (16 or more)
    block_k: int  # reduction step
    split: int = 1  # programs sharing one column block's reduction (partial sums)
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = BLOCK_M  # rows per program (16 or more)
    swap: bool = True  # the weight tile as the MMA's first operand (acc [block_n, block_m]), else x's

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
    def _gemv_kernel(X, W, OUT, MAX_V, MAX_I, M, N, K, stride_xm, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, ARGMAX: tl.constexpr,
                     PDL: tl.constexpr, SWAP: tl.constexpr):
        # program (row tile, column block, split): OUT[split, m, n] = sum over this split's k of X[m, k] W[n, k]
        # (OUT float32 partials) or, with one split, the product rounded to OUT's dtype; with ARGMAX (one split)
        # also each row's largest product of the block and its column (_block_argmax). SWAP: the MMA computes
        # [BLOCK_N, BLOCK_M] (weights first), else [BLOCK_M, BLOCK_N]
        _await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        rmask, cmask = rows < M, cols < N
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_start = split * K_SPLIT
        for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            w = tl.load(W + cols[:, None].to(tl.int64) * K + k[None, :], mask=cmask[:, None] & kmask[None, :],
                        other=0.0)
            x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        base = OUT + split.to(tl.int64) * M * N
        rounded = acc.to(OUT.dtype.element_ty)
        if SWAP:
            tl.store(base + rows[None, :] * N + cols[:, None], rounded, mask=cmask[:, None] & rmask[None, :])
            if ARGMAX:
                _block_argmax(rounded.to(tl.float32), rows, rmask, cols, cmask, MAX_V, MAX_I)
        else:
            tl.store(base + rows[:, None].to(tl.int64) * N + cols[None, :], rounded,
                     mask=rmask[:, None] & cmask[None, :])
            if ARGMAX:
                _block_argmax(tl.trans(rounded.to(tl.float32)), rows, rmask, cols, cmask, MAX_V, MAX_I)

    @triton.jit
    def _gate_up_silu_kernel(X, W, OUT, M, I, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                             SWAP: tl.constexpr):
        # program (row tile, column block): OUT[m, n] = silu(gate) * up for gate = X W[n].T and up = X W[I + n].T,
        # each rounded where F.silu(gate) * up of nn.Linear's outputs rounds (as kernels.silu_mul does); SWAP as in
        # _gemv_kernel
        _await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, cmask = rows < M, cols < I
        if SWAP:
            gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            wmask = cmask[:, None] & kmask[None, :]
            at = cols[:, None].to(tl.int64) * K + k[None, :]
            x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            if SWAP:
                xt = tl.trans(x)
                gate = tl.dot(tl.load(W + at, mask=wmask, other=0.0), xt, gate, input_precision=PRECISION)
                up = tl.dot(tl.load(W + I * K + at, mask=wmask, other=0.0), xt, up, input_precision=PRECISION)
            else:
                gate = tl.dot(x, tl.trans(tl.load(W + at, mask=wmask, other=0.0)), gate, input_precision=PRECISION)
                up = tl.dot(x, tl.trans(tl.load(W + I * K + at, mask=wmask, other=0.0)), up,
                            input_precision=PRECISION)
        dt = OUT.dtype.element_ty
        g = gate.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        out = (act * up.to(dt).to(tl.float32)).to(dt)
        if SWAP:
            tl.store(OUT + rows[None, :] * I + cols[:, None], out, mask=cmask[:, None] & rmask[None, :])
        else:
            tl.store(OUT + rows[:, None].to(tl.int64) * I + cols[None, :], out, mask=rmask[:, None] & cmask[None, :])


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether these kernels can multiply x [M, K] by weight [N, K] (2-D, same dtype, device the kernels run on)."""
    return (kernels.available(x.device) and x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and weight.is_contiguous())


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not supports(x, weight) or x.shape[1] != weight.shape[1] or x.stride(1) != 1:
        raise ValueError(f"gemv needs x [M, K] (unit stride along K) and a contiguous weight [N, K] of its dtype on a "
                         f"device the kernels run on; got x {tuple(x.shape)} {x.dtype} {x.device}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")


def _precision(x: torch.Tensor) -> str | None:
    return "ieee" if x.dtype == torch.float32 else None  # float32 products exact, as F.linear's (not tf32)


def partial_products(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T as float32 partial sums [S, M, N] (S = the shape's split, often 1): their sum in
    order, rounded to x's dtype, is the product. kernels.rms_norm and kernels.qk_norm_rope_store take them."""
    _check(x, weight)
    M, K = x.shape
    N = weight.shape[0]
    config = config or config_for("products", N, K, x)
    out = torch.empty((config.splits(K), M, N), dtype=torch.float32, device=x.device)
    _launch_products(x, weight, out, config)
    return out


def product(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T for a kernel that sums partial products itself (kernels.rms_norm,
    kernels.qk_norm_rope_store): partial_products' float32 [S, M, N], except above SMALL_ROWS rows where the config
    does not split: there the product rounded to x's dtype [M, N] (the bits the consumer would round the one float32
    partial to, in half the bytes). Up to SMALL_ROWS rows always partial_products (as measured in session 5)."""
    _check(x, weight)
    M, K = x.shape
    config = config or config_for("products", weight.shape[0], K, x)
    if M <= SMALL_ROWS or config.splits(K) > 1:
        return partial_products(x, weight, config)
    out = torch.empty((M, weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch_products(x, weight, out, config)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in x's dtype (no split: for products nothing fuses the sums into)."""
    config, out = _unsplit(x, weight, config, "linear")
    _launch_products(x, weight, out, config)
    return out


def linear_argmax(x: torch.Tensor, weight: torch.Tensor,
                  config: GemvConfig | None = None) -> tuple[torch.Tensor, kernels.BlockMaxima]:
    """linear(x, weight) and, from the same launch, each row's largest product per block of output columns with its
    first column (kernels.BlockMaxima [M, column blocks]): the lm_head's logits and what kernels.advance_rows needs
    to take their argmax, as torch.argmax would, without a launch of its own. The logits are linear's, bit for bit
    (the same config: the argmax only adds to the kernel's end)."""
    config, out = _unsplit(x, weight, config, "linear_argmax")
    M, N = out.shape
    blocks = triton.cdiv(N, config.block_n)
    maxima = kernels.BlockMaxima(torch.empty((M, blocks), dtype=torch.float32, device=x.device),
                                 torch.empty((M, blocks), dtype=torch.int32, device=x.device))
    _launch_products(x, weight, out, config, maxima)
    return out, maxima


def _unsplit(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None,
             caller: str) -> tuple[GemvConfig, torch.Tensor]:
    """linear's and linear_argmax's config (unsplit) and output [M, N] in x's dtype."""
    _check(x, weight)
    M, K = x.shape
    N = weight.shape[0]
    config = config or config_for("linear", N, K, x)
    if config.splits(K) != 1:
        raise ValueError(f"{caller} takes an unsplit config, got {config}")
    return config, torch.empty((M, N), dtype=x.dtype, device=x.device)


def _launch_products(x, weight, out, config: GemvConfig, maxima: kernels.BlockMaxima | None = None) -> None:
    M, K = x.shape
    N = weight.shape[0]
    grid = (triton.cdiv(M, config.block_m), triton.cdiv(N, config.block_n), config.splits(K))
    max_v, max_i = (maxima.values, maxima.index) if maxima is not None else (out, out)
    _gemv_kernel[grid](x, weight, out, max_v, max_i, M, N, K, x.stride(0), K_SPLIT=config.k_per_split(K),
                       BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                       PRECISION=_precision(x), ARGMAX=maxima is not None, SWAP=config.swap,
                       num_warps=config.num_warps, num_stages=config.num_stages, **kernels.pdl_options(x.device, M))


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """The MLP's first half in one kernel: x [M, K], gate|up weight [2I, K] -> silu(x gate.T) * (x up.T) [M, I]."""
    _check(x, weight)
    M, K = x.shape
    I = weight.shape[0] // 2
    if weight.shape[0] != 2 * I:
        raise ValueError(f"gate|up weight needs an even number of rows, got {tuple(weight.shape)}")
    config = config or config_for("gate_up_silu", I, K, x)
    out = torch.empty((M, I), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, config.block_m), triton.cdiv(I, config.block_n))
    _gate_up_silu_kernel[grid](x, weight, out, M, I, K, x.stride(0), BLOCK_M=config.block_m,
                               BLOCK_N=config.block_n, BLOCK_K=config.block_k, PRECISION=_precision(x),
                               SWAP=config.swap, num_warps=config.num_warps, num_stages=config.num_stages,
                               **kernels.pdl_options(x.device, M))
    return out


# -- configs: one per (kind, N, K, row class, dtype, device), chosen at first use, never inside a graph capture -----

KINDS = ("products", "linear", "gate_up_silu")
_chosen: dict[tuple, GemvConfig] = {}


def _pow2_at_most(n: int, cap: int) -> int:
    p = 16
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def _split_for(N: int, K: int, block_n: int, block_k: int, programs: int, row_tiles: int = 1) -> int:
    """The fewest splits (a power of two) that give ~`programs` programs, each still a whole block_k of reduction."""
    split = 1
    while row_tiles * -(-N // block_n) * split * 2 <= programs and K // (split * 2) >= block_k:
        split *= 2
    return split


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def candidates(kind: str, N: int, K: int, device: torch.device, rows: int = SMALL_ROWS,
               sms: int | None = None) -> list[GemvConfig]:
    """The few configs tried for a shape and row class (`row_class`) on a GPU of `sms` SMs (default: the device's);
    the first is the heuristic one. In the CPU interpreter a program is a Python call: there the blocks are as large
    as the shape, so tests of real-vocabulary heads stay fast (above SMALL_ROWS rows in 64-row tiles of the unswapped
    orientation, as on the GPU)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    rows = row_class(rows)
    if device.type != "cuda":
        big = {} if rows == SMALL_ROWS else {"block_m": 64, "swap": False}
        return [GemvConfig(block_n=_pow2_at_most(N, 4096), block_k=_pow2_at_most(K, 256), **big)]
    if rows > SMALL_ROWS:
        return _large_candidates(kind, N, K, rows, sms or _sm_count(device))
    programs = 2 * (sms or _sm_count(device))
    block_k = _pow2_at_most(K, 128)
    out = []
    widths = (64, 128, 32) if kind == "linear" else (64, 32, 128) if kind == "products" else (32, 16, 64)
    for block_n in widths:
        if kind == "products":
            split = _split_for(N, K, block_n, block_k, programs)
            out += [GemvConfig(block_n, block_k, s) for s in dict.fromkeys((split, max(1, split // 4)))]
        else:
            out.append(GemvConfig(block_n, block_k))
    return out


def _large_candidates(kind: str, N: int, K: int, rows: int, sms: int) -> list[GemvConfig]:
    """Configs for a row class above SMALL_ROWS: tiles of 64 or 128 rows multiplying x by the weights (the MMA's
    M side is the rows, as large products run), or 32-64 rows with the weights first (as the small class does); a
    split where the tiles alone leave SMs idle (~1 program an SM for the large tiles, ~2 for the others), and for
    products the same tiles with a quarter of the split (fewer partial sums to write and read back). At most five:
    each is compiled and timed at first use on the GPU."""
    tiles = [  # (block_m, block_n, block_k, swap, num_warps, num_stages, programs an SM)
        (64, 128, 64, False, 4, 4, 1),
        (64, 64, 128, False, 4, 3, 2),
        (min(rows, 64) if kind == "linear" else 32, 128, 128, True, 4, 3, 2),
    ]
    if rows >= 128:
        tiles.append((128, 128 if kind != "gate_up_silu" else 64, 64, False, 8, 3, 1))
    if kind == "gate_up_silu":  # two weight tiles a step: narrower ones (shared memory, registers)
        tiles[0] = (64, 64, 64, False, 4, 3, 2)
        tiles[1] = (64, 128, 64, False, 8, 3, 1)
        tiles[2] = (32, 64, 128, True, 4, 3, 2)
        if rows <= 64:  # no split to add programs: 3072 columns of 64 rows are 48 of the tiles above
            tiles.append((32, 32, 128, True, 4, 3, 2))
    first, fewer = [], []  # every tile at its split first, then the products' tiles with a quarter of it
    for block_m, block_n, block_k, swap, warps, stages, per_sm in tiles:
        block_k = min(block_k, _pow2_at_most(K, 128))
        shape = dict(block_m=block_m, swap=swap, num_warps=warps, num_stages=stages)
        if kind != "products":
            first.append(GemvConfig(block_n, block_k, **shape))
            continue
        split = _split_for(N, K, block_n, block_k, per_sm * sms, -(-rows // block_m))
        first.append(GemvConfig(block_n, block_k, split, **shape))
        if split > 1:
            fewer.append(GemvConfig(block_n, block_k, max(1, split // 4), **shape))
    programs = lambda c: -(-rows // c.block_m) * -(-N // c.block_n) * c.splits(K)  # noqa: E731
    first.sort(key=lambda c: programs(c) < sms)  # the heuristic (first) one fills the SMs where one does
    return list(dict.fromkeys(first + fewer))[:5]


def config_for(kind: str, N: int, K: int, x: torch.Tensor) -> GemvConfig:
    """The config of this shape and x's row class (row_class(x.shape[0])): on CUDA the fastest of `candidates`
    (timed once, outside graph capture, at 1 and 16 rows for the small class, at the class's rows above it;
    $QASR_GEMV_TUNE=0 takes the heuristic one), elsewhere the heuristic one."""
    rows = row_class(x.shape[0])
    key = (kind, N, K, rows, x.dtype, x.device)
    if key not in _chosen:
        options = candidates(kind, N, K, x.device, rows)
        tune = (x.device.type == "cuda" and len(options) > 1 and os.environ.get(TUNE_ENV, "1") != "0"
                and not torch.cuda.is_current_stream_capturing())
        _chosen[key] = _fastest(kind, N, K, rows, x, options) if tune else options[0]
    return _chosen[key]


def _fastest(kind: str, N: int, K: int, rows: int, x: torch.Tensor, options: list[GemvConfig]) -> GemvConfig:
    t0 = time.perf_counter()
    weight = torch.randn(2 * N if kind == "gate_up_silu" else N, K, device=x.device).to(x.dtype)
    run = {"products": partial_products, "linear": linear, "gate_up_silu": gate_up_silu}[kind]
    sizes = (1, BLOCK_M) if rows == SMALL_ROWS else (rows,)
    if kind == "products" and rows > SMALL_ROWS:
        # above the small class the partial sums' bytes count: time the product with a consumer reading them back
        # (an RMSNorm over the N outputs, as add+RMSNorm and q/k-norm+RoPE read them)
        ones = torch.ones(N, device=x.device, dtype=x.dtype)
        run = lambda a, w, c: kernels.rms_norm(product(a, w, c), ones, 1e-6)  # noqa: E731
    timed = {}
    for config in options:
        try:
            total = 0.0
            for M in sizes:
                xs = torch.randn(M, K, device=x.device).to(x.dtype)
                total += time_ms(lambda: run(xs, weight, config))
        except triton.runtime.errors.OutOfResources as e:  # a tile too large for this GPU's shared memory
            log.warning("gemv %s N=%d K=%d: %s skipped (%s)", kind, N, K, config, e)
            continue
        timed[config] = total
    if not timed:
        raise RuntimeError(f"gemv {kind} N={N} K={K}: none of {options} runs on {x.device}")
    best = min(timed, key=timed.get)
    log.info("gemv %s N=%d K=%d rows %s: %s (%s ms at %s rows; tried %d configs in %.1f s)", kind, N, K,
             _class_name(rows), best, f"{timed[best]:.4f}", " + ".join(map(str, sizes)), len(options),
             time.perf_counter() - t0)
    return best


def _class_name(rows: int) -> str:
    i = ROW_CLASSES.index(rows)
    return f"1-{rows}" if i == 0 else f"{ROW_CLASSES[i - 1] + 1}-{rows}" + ("+" if rows == ROW_CLASSES[-1] else "")


def time_ms(fn, runs: int = 20) -> float:
    """Mean GPU time of fn() over `runs` launches, after warm-up (its first call compiles)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / runs


def chosen_configs() -> dict[str, str]:
    """What has been chosen so far, for benchmark reports."""
    return {f"{kind} N={N} K={K} {str(dtype).removeprefix('torch.')} rows {_class_name(rows)}": str(c)
            for (kind, N, K, rows, dtype, _), c in _chosen.items()}


def forget_configs() -> None:
    """Choose again at next use (tests; a benchmark comparing settings)."""
    _chosen.clear()

