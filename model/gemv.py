"""Matrix products of the decode step's few rows: weight-streaming GEMV / skinny GEMM kernels in Triton.

At decode a layer multiplies 1..32 rows by weights of 4-12 MB. cuBLAS picks kernels built for large products, which
take 5-10 us where the weight bytes need 1-3 us at the H200's bandwidth (docs/benchmarks.md). Here a program owns
BLOCK_N output columns of up to 16 rows (and, where N alone gives too few programs, 1/SPLIT of the reduction): it
streams its weight tile once and multiplies on tensor cores with the weight tile as the MMA's long side ("swap AB"),
accumulating in float32.

Split-K partial sums are not reduced here (that would be one more launch): `partial_products` returns them as float32
[S, M, N] and the kernel that consumes the product (add+RMSNorm, q/k-norm+RoPE in kernels.py) sums them in a fixed
order and rounds to the activation dtype, as nn.Linear's output would be rounded.

In the decode step the add+RMSNorms are folded in too (#16; $QASR_FUSE_NORMS=0 keeps them apart): `add_products`
(o_proj, down) adds its product into the residual stream itself, the last of a tile's split-K programs to finish
(an atomic ticket) summing the partials in split order, so the stream is bit for bit kernels.rms_norm's, and leaves
each row's sum of squares per column block; the qkv and gate_up GEMVs take that as a kernels.PendingNorm and norm
their rows as they load them. The norm's scale adds the squares in another order than kernels.rms_norm (per column
block, then the blocks: still one fixed order per shape), so a normed element may differ from the unfused one by a
rounding of the activation dtype.

The lm_head's product can also take each row's argmax (linear_argmax): every program leaves its column block's
largest logit and that logit's first column, and kernels.advance_rows reduces those in the launch it makes anyway.

Row independence: a row's result depends only on its own input and on the config, and the config is chosen per weight
shape (N, K), never per batch, so every bucket up to `max_rows()` runs the same reduction order: a row gets the same
bits whatever its batch mates and its bucket. More than 16 rows are more programs over the same 16-row tile.

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

BLOCK_M = 16  # rows per tile: the smallest MMA side, padded with masked rows
DEFAULT_MAX_ROWS = 32
MAX_ROWS_ENV = "QASR_DECODE_GEMV"  # rows up to which the decode step's products use these kernels; 0: cuBLAS only
TUNE_ENV = "QASR_GEMV_TUNE"  # "0": take each shape's heuristic config instead of timing a few at first use
FUSE_NORMS_ENV = "QASR_FUSE_NORMS"  # "1" (default): the decode step's add+RMSNorms fused into its GEMVs; "0": apart


def max_rows() -> int:
    """Rows up to which products stream their weights through these kernels ($QASR_DECODE_GEMV, default 32)."""
    value = os.environ.get(MAX_ROWS_ENV, str(DEFAULT_MAX_ROWS))
    if not value.isdigit():
        raise ValueError(f"{MAX_ROWS_ENV} must be a whole number of rows (0: off), got {value!r}")
    return int(value)


def fuse_norms() -> bool:
    """Whether $QASR_FUSE_NORMS asks for the decode step's add+RMSNorms fused into its GEMVs ("1" or unset; "0":
    each its own launch). Read when a step is built (so a graph keeps what it was captured with)."""
    value = os.environ.get(FUSE_NORMS_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{FUSE_NORMS_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def counters_needed(rows: int, columns: int) -> int:
    """The int32 counters add_products needs for `rows` rows of `columns` outputs, whatever the config (block_n >= 16)."""
    return _row_tiles(rows) * -(-columns // 16)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program (the MMA's long side: 16 or more)
    block_k: int  # reduction step
    split: int = 1  # programs sharing one column block's reduction (partial sums)
    num_warps: int = 4
    num_stages: int = 3

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
    def _row_rstd(SSQ, rows, rmask, NB, K, eps, NORM: tl.constexpr, NB_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
        # NORM: each row's RMSNorm scale 1 / rms from the sums of squares the producer left per column block
        # (SSQ [M, NB], added in one fixed order: a row's scale depends only on its own values); else unused
        if NORM:
            j = tl.arange(0, NB_BLOCK)
            s = tl.load(SSQ + rows[:, None] * NB + j[None, :], mask=rmask[:, None] & (j < NB)[None, :], other=0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(s, axis=1) / K + eps)
        else:
            rstd = tl.zeros([BLOCK_M], tl.float32)
        return rstd

    @triton.jit
    def _x_tile(X, NW, rows, rmask, k, kmask, stride_xm, rstd, NORM: tl.constexpr):
        # the input tile [BLOCK_M, BLOCK_K]: X's, or with NORM X (the residual stream h) normed on load as
        # kernels.rms_norm writes its output: (h * rstd) rounded, times the norm's weight NW, rounded
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if NORM:
            dt = X.dtype.element_ty
            w = tl.load(NW + k, mask=kmask, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32) * w[None, :]).to(dt)
        return x

    @triton.jit
    def _add_into_residual(OUT, R, SSQ, COUNT, rows, rmask, cols, cmask, M, N):
        # split-K's last program of this (row tile, column block) to finish (a ticket per tile in COUNT, left at 0
        # again for the next launch): sums the tile's partial products in split order, rounds, adds them into the
        # residual stream R in place (rounded: kernels.rms_norm's add, bit for bit) and stores each row's sum of
        # squares of the new values of these columns at SSQ[m, column block]. Every element of R is read and
        # written by this one program, so nothing races; the other programs only left their partials.
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        splits = tl.num_programs(2)
        tl.debug_barrier()  # every thread's partial stored before the ticket releases them
        ticket = tl.atomic_add(COUNT + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            tl.store(COUNT + tile, 0)
            mask = cmask[:, None] & rmask[None, :]
            at = rows[None, :] * N + cols[:, None]  # [BLOCK_N, BLOCK_M], as the products' tile
            acc = tl.load(OUT + at, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                acc += tl.load(OUT + s * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")  # M N S < 2**31
            dt = R.dtype.element_ty
            h = (acc.to(dt).to(tl.float32) + tl.load(R + at, mask=mask, other=0.0).to(tl.float32)).to(dt)
            tl.store(R + at, h, mask=mask)
            h = h.to(tl.float32)
            tl.store(SSQ + rows * tl.num_programs(1) + tl.program_id(1), tl.sum(h * h, axis=0), mask=rmask)

    @triton.jit
    def _gemv_kernel(X, W, OUT, MAX_V, MAX_I, NW, SSQ_IN, R, SSQ, COUNT, M, N, K, stride_xm, NB_IN, eps,
                     K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr, ARGMAX: tl.constexpr, NORM: tl.constexpr, NB_BLOCK: tl.constexpr,
                     ADD: tl.constexpr, PDL: tl.constexpr):
        # program (row tile, column block, split): OUT[split, m, n] = sum over this split's k of X[m, k] W[n, k]
        # (OUT float32 partials) or, with one split, the product rounded to OUT's dtype; with ARGMAX (one split)
        # also each row's largest product of the block and its column (_block_argmax). NORM: X is the residual
        # stream, normed on load (_x_tile, its scale from SSQ_IN [M, NB_IN]); ADD: the product is also added into
        # the residual stream R, with its sums of squares left in SSQ (_add_into_residual)
        _await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        rmask, cmask = rows < M, cols < N
        rstd = _row_rstd(SSQ_IN, rows, rmask, NB_IN, K, eps, NORM, NB_BLOCK, BLOCK_M)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        k_start = split * K_SPLIT
        for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            w = tl.load(W + cols[:, None].to(tl.int64) * K + k[None, :], mask=cmask[:, None] & kmask[None, :],
                        other=0.0)
            x = _x_tile(X, NW, rows, rmask, k, kmask, stride_xm, rstd, NORM)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        out = OUT + split.to(tl.int64) * M * N + rows[None, :] * N + cols[:, None]
        rounded = acc.to(OUT.dtype.element_ty)
        tl.store(out, rounded, mask=cmask[:, None] & rmask[None, :])
        if ARGMAX:
            _block_argmax(rounded.to(tl.float32), rows, rmask, cols, cmask, MAX_V, MAX_I)
        if ADD:
            _add_into_residual(OUT, R, SSQ, COUNT, rows, rmask, cols, cmask, M, N)

    @triton.jit
    def _gate_up_silu_kernel(X, W, OUT, NW, SSQ_IN, M, I, K, stride_xm, NB_IN, eps, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                             NORM: tl.constexpr, NB_BLOCK: tl.constexpr, PDL: tl.constexpr):
        # program (row tile, column block): OUT[m, n] = silu(gate) * up for gate = X W[n].T and up = X W[I + n].T,
        # each rounded where F.silu(gate) * up of nn.Linear's outputs rounds (as kernels.silu_mul does); NORM: X is
        # the residual stream, normed on load (as _gemv_kernel's)
        _await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, cmask = rows < M, cols < I
        rstd = _row_rstd(SSQ_IN, rows, rmask, NB_IN, K, eps, NORM, NB_BLOCK, BLOCK_M)
        gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            wmask = cmask[:, None] & kmask[None, :]
            at = cols[:, None].to(tl.int64) * K + k[None, :]
            x = tl.trans(_x_tile(X, NW, rows, rmask, k, kmask, stride_xm, rstd, NORM))
            gate = tl.dot(tl.load(W + at, mask=wmask, other=0.0), x, gate, input_precision=PRECISION)
            up = tl.dot(tl.load(W + I * K + at, mask=wmask, other=0.0), x, up, input_precision=PRECISION)
        dt = OUT.dtype.element_ty
        g = gate.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        out = (act * up.to(dt).to(tl.float32)).to(dt)
        tl.store(OUT + rows[None, :] * I + cols[:, None], out, mask=cmask[:, None] & rmask[None, :])


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


def _row_tiles(M: int) -> int:
    return -(-M // BLOCK_M)


Input = torch.Tensor | kernels.PendingNorm  # a product's input: rows, or the residual stream to norm on load


def _rows(x: Input) -> torch.Tensor:
    """The tensor a product reads its rows from: x, or a pending norm's residual stream [M, K]."""
    return x.residual if isinstance(x, kernels.PendingNorm) else x


def partial_products(x: Input, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T as float32 partial sums [S, M, N] (S = the shape's split, often 1): their sum in
    order, rounded to x's dtype, is the product. kernels.rms_norm and kernels.qk_norm_rope_store take them.
    x may be a kernels.PendingNorm: its norm is taken as the rows are loaded (no launch of its own)."""
    rows = _rows(x)
    _check(rows, weight)
    M, K = rows.shape
    N = weight.shape[0]
    config = config or config_for("products", N, K, rows)
    out = torch.empty((config.splits(K), M, N), dtype=torch.float32, device=rows.device)
    _launch_products(x, weight, out, config)
    return out


def add_products(x: Input, weight: torch.Tensor, residual: torch.Tensor, counters: torch.Tensor,
                 config: GemvConfig | None = None) -> torch.Tensor:
    """residual += x @ weight.T in one launch, bit for bit kernels.rms_norm's add of partial_products(x, weight):
    the split-K partials summed in split order and rounded, then added and rounded. Returns each row's sum of
    squares of the new residual per block of output columns, float32 [M, blocks], for a kernels.PendingNorm.

    residual: contiguous [M, N] of x's dtype. counters: int32 zeros, at least row tiles x column blocks, owned by
    one stream's launches (each launch leaves them zero again; two launches at once must not share them)."""
    rows = _rows(x)
    _check(rows, weight)
    M, K = rows.shape
    N = weight.shape[0]
    if residual.shape != (M, N) or residual.dtype != rows.dtype or not residual.is_contiguous():
        raise ValueError(f"add_products needs a contiguous {rows.dtype} residual {(M, N)}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    config = config or config_for("products", N, K, rows)
    blocks = triton.cdiv(N, config.block_n)
    if counters.dtype != torch.int32 or counters.numel() < _row_tiles(M) * blocks:
        raise ValueError(f"add_products needs int32 counters for {_row_tiles(M) * blocks} tiles, got "
                         f"{counters.numel()} {counters.dtype}")
    out = torch.empty((config.splits(K), M, N), dtype=torch.float32, device=rows.device)
    ssq = torch.empty((M, blocks), dtype=torch.float32, device=rows.device)
    _launch_products(x, weight, out, config, add=(residual, ssq, counters))
    return ssq


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


def _norm_args(x: Input) -> dict:
    """The kernels' arguments of an input that may be a pending norm (NW, SSQ_IN, NB_IN, eps, NORM, NB_BLOCK)."""
    if not isinstance(x, kernels.PendingNorm):
        return dict(NW=x, SSQ_IN=x, NB_IN=1, eps=0.0, NORM=False, NB_BLOCK=1)
    M, K = x.residual.shape
    nb = x.ssq.shape[1]
    if (not x.residual.is_contiguous() or x.ssq.shape[0] != M or x.ssq.dtype != torch.float32
            or not x.ssq.is_contiguous() or x.weight.shape != (K,)):
        raise ValueError(f"a pending norm needs a contiguous residual [M, K], float32 sums of squares [M, blocks] and "
                         f"a weight [K]; got {tuple(x.residual.shape)}, {tuple(x.ssq.shape)} {x.ssq.dtype}, "
                         f"{tuple(x.weight.shape)}")
    return dict(NW=x.weight, SSQ_IN=x.ssq, NB_IN=nb, eps=x.eps, NORM=True, NB_BLOCK=triton.next_power_of_2(nb))


def _launch_products(x: Input, weight, out, config: GemvConfig, maxima: kernels.BlockMaxima | None = None,
                     add: tuple | None = None) -> None:
    rows = _rows(x)
    M, K = rows.shape
    N = weight.shape[0]
    grid = (_row_tiles(M), triton.cdiv(N, config.block_n), config.splits(K))
    max_v, max_i = (maxima.values, maxima.index) if maxima is not None else (out, out)
    residual, ssq, counters = add if add is not None else (out, out, out)
    _gemv_kernel[grid](rows, weight, out, max_v, max_i, R=residual, SSQ=ssq, COUNT=counters, M=M, N=N, K=K,
                       stride_xm=rows.stride(0), K_SPLIT=config.k_per_split(K), BLOCK_M=BLOCK_M,
                       BLOCK_N=config.block_n, BLOCK_K=config.block_k, PRECISION=_precision(rows),
                       ARGMAX=maxima is not None, ADD=add is not None, num_warps=config.num_warps,
                       num_stages=config.num_stages, **_norm_args(x), **kernels.pdl_options(rows.device, M))


def gate_up_silu(x: Input, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """The MLP's first half in one kernel: x [M, K], gate|up weight [2I, K] -> silu(x gate.T) * (x up.T) [M, I].
    x may be a kernels.PendingNorm (normed as it is loaded)."""
    rows = _rows(x)
    _check(rows, weight)
    M, K = rows.shape
    I = weight.shape[0] // 2
    if weight.shape[0] != 2 * I:
        raise ValueError(f"gate|up weight needs an even number of rows, got {tuple(weight.shape)}")
    config = config or config_for("gate_up_silu", I, K, rows)
    out = torch.empty((M, I), dtype=rows.dtype, device=rows.device)
    grid = (_row_tiles(M), triton.cdiv(I, config.block_n))
    _gate_up_silu_kernel[grid](rows, weight, out, M=M, I=I, K=K, stride_xm=rows.stride(0), BLOCK_M=BLOCK_M,
                               BLOCK_N=config.block_n, BLOCK_K=config.block_k, PRECISION=_precision(rows),
                               num_warps=config.num_warps, num_stages=config.num_stages, **_norm_args(x),
                               **kernels.pdl_options(rows.device, M))
    return out


# -- configs: one per (kind, N, K, dtype, device), chosen at first use, never inside a graph capture --------------

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


def candidates(kind: str, N: int, K: int, device: torch.device) -> list[GemvConfig]:
    """The few configs tried for a shape; the first is the heuristic one. In the CPU interpreter a program is a
    Python call: there the blocks are as large as the shape, so tests of real-vocabulary heads stay fast."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if device.type != "cuda":
        return [GemvConfig(block_n=_pow2_at_most(N, 4096), block_k=_pow2_at_most(K, 256))]
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
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


def config_for(kind: str, N: int, K: int, x: torch.Tensor) -> GemvConfig:
    """The config of this shape: on CUDA the fastest of `candidates` at 1 and 16 rows (timed once, outside graph
    capture; $QASR_GEMV_TUNE=0 takes the heuristic one), elsewhere the heuristic one."""
    key = (kind, N, K, x.dtype, x.device)
    if key not in _chosen:
        options = candidates(kind, N, K, x.device)
        tune = (x.device.type == "cuda" and len(options) > 1 and os.environ.get(TUNE_ENV, "1") != "0"
                and not torch.cuda.is_current_stream_capturing())
        _chosen[key] = _fastest(kind, N, K, x, options) if tune else options[0]
    return _chosen[key]


def _fastest(kind: str, N: int, K: int, x: torch.Tensor, options: list[GemvConfig]) -> GemvConfig:
    t0 = time.perf_counter()
    rows = 2 * N if kind == "gate_up_silu" else N
    weight = torch.randn(rows, K, device=x.device).to(x.dtype)
    run = {"products": partial_products, "linear": linear, "gate_up_silu": gate_up_silu}[kind]
    timed = {}
    for config in options:
        total = 0.0
        for M in (1, BLOCK_M):
            xs = torch.randn(M, K, device=x.device).to(x.dtype)
            total += time_ms(lambda: run(xs, weight, config))
        timed[config] = total
    best = min(timed, key=timed.get)
    log.info("gemv %s N=%d K=%d: %s (%s ms at 1 + %d rows; tried %d configs in %.1f s)", kind, N, K, best,
             f"{timed[best]:.4f}", BLOCK_M, len(options), time.perf_counter() - t0)
    return best


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
    return {f"{kind} N={N} K={K} {str(dtype).removeprefix('torch.')}": str(c)
            for (kind, N, K, dtype, _), c in _chosen.items()}


def forget_configs() -> None:
    """Choose again at next use (tests; a benchmark comparing settings)."""
    _chosen.clear()

