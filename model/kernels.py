"""Fused Triton kernels for the text decoder on CUDA.

The plain PyTorch decoder runs ~50 tiny kernels per layer (an RMSNorm alone is seven: cast, pow, mean, rsqrt, mul,
cast, mul); in a CUDA graph each still costs ~2.5 us of GPU time, so at batch 1 the step was kernel-count bound, not
bandwidth bound (docs/benchmarks.md). These kernels bring a layer down to nine: add+RMSNorm, qkv matmul,
q/k-norm+RoPE+KV write, attention, o_proj, add+RMSNorm, gate_up matmul, SiLU*mul, down matmul. Prefill uses the same
nine (its attention reads the cache in place: no gathered copies, masks or SDPA), so a small admission is ~250
launches instead of ~1,500. In the decode step's small buckets the matmuls are gemv.py's instead of cuBLAS's; the
add+RMSNorm and q/k-norm+RoPE kernels then take the matmul's split-K partial sums and add them up themselves.

The decode step's ends are kernels too: its start (embedding lookup, the positions' clamp and scratch redirect, the
residual copy, the first RMSNorm) is decode_begin's one launch, and advance_rows takes the argmax of the GEMV lm_head's
block maxima (gemv.linear_argmax) itself, so at small batch no PyTorch op sits between a step's first kernel and its
last (session 6: seven at the start and the argmax, each a break in the PDL chain below).

Each kernel rounds to the activation dtype wherever the PyTorch reference does (modeling.py), so the two paths differ
only in reduction order. Every row is computed by its own programs: a row's result never depends on its batch mates.
The tests run them on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

Programmatic dependent launch (Hopper and later; on by default, $QASR_PDL=0 turns it off): every kernel here and in
gemv.py over at most PDL_MAX_ROWS rows (the decode step's small buckets) is launched with the PDL attribute, so the
GPU may start its programs while the kernel before it in the stream is still running (CUDA graph capture keeps this
as a programmatic edge). Each program's first statement is
`_await_inputs`: it waits until the previous kernel has finished and its writes are visible, and only then lets the
next kernel launch. As every PDL kernel waits before it touches memory, a kernel's completion implies its
predecessors' completions too, so reading an output from several kernels back (the residual stream) stays safe, and
kernels from cuBLAS or PyTorch between them simply start after the previous kernel ends, as they always did. What
overlaps is one kernel's launch, scheduling and prologue with the tail of the one before. The interpreter never sees
the calls: the flag is a constexpr, off wherever the kernels do not run on a GPU that has PDL.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the decoder uses its PyTorch path
    triton = None

log = logging.getLogger(__name__)

PDL_ENV = "QASR_PDL"  # "1" (default): programmatic dependent launch where the GPU has it (use_pdl); "0": none
# (on the H200 the decode step at B=1 went 1.175 -> 1.039 ms with logits bit-identical: docs/benchmarks.md)
# Launches of up to this many rows (tokens) take PDL: in the decode step's buckets up to 32 the products are gemv.py's
# and all the step's 227 launches are one chain of Triton kernels (session 6: 227 of 235, see decode_begin); above,
# every product is a cuBLAS kernel, which breaks the chain (114 breaks a step at 64 rows), and on the H200 PDL gained
# nothing at 64 rows and cost 4% at 256.
PDL_MAX_ROWS = 32


def available(device: torch.device) -> bool:
    """Whether the fused kernels can run on tensors of `device`."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def pdl_requested() -> bool:
    """Whether $QASR_PDL asks for programmatic dependent launch ("1" or unset; "0": no)."""
    value = os.environ.get(PDL_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched now on `device` use programmatic dependent launch: asked for ($QASR_PDL=1), on a CUDA
    GPU of compute capability 9.0 or later, with a Triton that has grid dependency control, never in the interpreter
    (by default: a GPU or Triton without it quietly goes without; asked for explicitly, a warning says why).
    Read at every launch, so a graph captured with it on keeps it (kernel_check captures both ways in one process)."""
    if not pdl_requested() or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _pdl_supported(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _pdl_supported(index: int) -> bool:
    major, minor = torch.cuda.get_device_capability(index)
    has_gdc = triton is not None and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")
    if major < 9 or not has_gdc:
        log.log(logging.WARNING if PDL_ENV in os.environ else logging.DEBUG,
                "%s=1 ignored on cuda:%d: programmatic dependent launch needs compute capability 9.0+ (this GPU has "
                "%d.%d) and a Triton with tl.extra.cuda.gdc_wait (%s)", PDL_ENV, index, major, minor,
                "present" if has_gdc else "missing")
        return False
    return True


if triton is not None:

    @triton.jit
    def _await_inputs(PDL: tl.constexpr):
        # With programmatic dependent launch this program may be running before the kernel ahead of it has finished:
        # wait for that kernel (all its programs done, their writes visible) before any load or store, then allow the
        # next kernel to launch (it waits the same way). Without PDL (and in the interpreter): nothing.
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _load_input(X, offs, mask, split_stride, SPLITS: tl.constexpr, OUT):
        # an input as float32: X itself (SPLITS 0) or the sum, in split order, of SPLITS float32 partial products
        # split_stride apart (gemv.partial_products), rounded to OUT's dtype as the unsplit product would be
        if SPLITS == 0:
            return tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        acc = tl.load(X + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(X + s * split_stride + offs, mask=mask, other=0.0)
        return acc.to(OUT.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _round_to_e4m3(v):
        # v: float32 with |v| <= 448 -> the nearest e4m3 value (ties to even), still float32, so that the cast after
        # it is exact (a GPU's cast and the interpreter's, which rounds e4m3 wrongly, then agree with PyTorch's bit
        # for bit). Normal range: drop the low 20 of 23 mantissa bits, rounding to nearest even (a carry moves into
        # the exponent, as it must). Below 2^-6 (e4m3's subnormals, a fixed step of 2^-9): add and take away 2^14,
        # whose float32 ulp is 2^-9. The sign is kept as it is (a negative value that rounds to zero is -0).
        bits = v.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 0xFFF00000
        a = tl.abs(v)
        sub = (a + 16384.0) - 16384.0
        sub = tl.where(bits < 0, -sub, sub)
        return tl.where(a < 0.015625, sub, normal)

    @triton.jit
    def _store_e4m3(y, Q, S, row, cols, mask, D):
        # one row y (float32 [BLOCK], zero past D) as fp8.quantize_rows stores it: S[row] = its scale, max(amax *
        # (1 / 448), fp8.MIN_SCALE), and Q[row] = e4m3(y * (1 / scale)): one division a row, not one an element
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) * (1.0 / 448.0), 1e-12)
        v = tl.minimum(tl.maximum(y * tl.math.div_rn(1.0, scale), -448.0), 448.0)
        tl.store(Q + row * D + cols, _round_to_e4m3(v).to(tl.float8e4nv), mask=mask)
        tl.store(S + row, scale)

    @triton.jit
    def _norm_store(h, W, Y, S, row, cols, mask, D, eps, FP8: tl.constexpr):
        # y[row] = norm(h) * w for one row h (float32 [BLOCK], zero past D), rounded where RMSNorm rounds (to Y's
        # dtype; with FP8 to the weight's, the model's, and then stored as e4m3 with its scale in S)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if FP8:
            dt = W.dtype.element_ty
            y = ((h * rstd).to(dt).to(tl.float32) * w).to(dt)
            _store_e4m3(y.to(tl.float32), Y, S, row, cols, mask, D)
        else:
            y = (h * rstd).to(Y.dtype.element_ty).to(tl.float32) * w
            tl.store(Y + row * D + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_kernel(X, R, W, Y, S, D, eps, split_stride, SPLITS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         FP8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # one row: h = residual + x (stored back into the residual) or h = x; y = norm(h) * w (FP8: as e4m3, scale
        # in S)
        _await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        if FP8:  # partial sums rounded to the model's dtype (the weight's), as without FP8 to the output's
            h = _load_input(X, row * D + cols, mask, split_stride, SPLITS, W)
        else:
            h = _load_input(X, row * D + cols, mask, split_stride, SPLITS, Y)
        if HAS_RESIDUAL:
            r = tl.load(R + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            h = (h + r).to(R.dtype.element_ty)
            tl.store(R + row * D + cols, h, mask=mask)
            h = h.to(tl.float32)
        _norm_store(h, W, Y, S, row, cols, mask, D, eps, FP8)

    @triton.jit
    def _decode_begin_kernel(TOKENS, POSITIONS, EMBED, W, Y, R, ROPE_POS, SLOTS, WRITE_POS, D, V, scratch, eps,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
        # the decode step's start for row b (see decode_begin): its position's three uses, its token's embedding
        # into the residual stream, and the first layer's RMSNorm of it
        _await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        pos = tl.load(POSITIONS + row)
        tl.store(ROPE_POS + row, tl.maximum(pos, 0))
        tl.store(SLOTS + row, row)
        tl.store(WRITE_POS + row, tl.where(pos >= 0, pos, scratch))
        token = tl.minimum(tl.maximum(tl.load(TOKENS + row), 0), V - 1).to(tl.int64)  # never read past the table
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(EMBED + token * D + cols, mask=mask, other=0.0)
        tl.store(R + row * D + cols, x, mask=mask)
        _norm_store(x.to(tl.float32), W, Y, Y, row, cols, mask, D, eps, False)

    @triton.jit
    def _norm_rope(x1, x2, W, c, s, half, eps, HD: tl.constexpr, OUT):
        # heads [rows, HD] as their halves x1, x2 (float32 [rows, HD / 2]): RMS-normed over each head, times the norm's
        # weight W, then rotated by the cos/sin rows c, s ([HD / 2] each: the two halves of a table row repeat), rounded
        # where the eager ops round (to OUT's dtype); rotate_half(x) = [-x2, x1]
        dt = OUT.dtype.element_ty
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)
        w1 = tl.load(W + half).to(tl.float32)[None, :]
        w2 = tl.load(W + HD // 2 + half).to(tl.float32)[None, :]
        x1 = ((x1 * rstd[:, None]).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        c, s = c[None, :], s[None, :]
        o1 = ((x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
        return o1, o2

    @triton.jit
    def _qk_norm_rope_store_kernel(
        QKV, Q, K_CACHE, V_CACHE, K_SCALE, V_SCALE, QW, KW, COS, SIN, ROPE_POS, SLOT, WRITE_POS,
        stride_qkv, stride_cs, stride_ch, stride_cl, stride_ss, stride_sh, eps, split_stride,
        H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HEADS: tl.constexpr, SPLITS: tl.constexpr,
        INT8: tl.constexpr, PDL: tl.constexpr,
    ):
        # program (token n, group j of HEADS heads; HEADS divides H and KVH): a group j < H / HEADS is query heads
        # (-> Q[n, heads]), the others KV heads, whose normed and rotated keys and plain values go to the cache at
        # [slot[n], kv head, write_pos[n]]; with INT8 as kv_int8's words, their scales into K_SCALE / V_SCALE
        _await_inputs(PDL)
        n = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * HEADS
        head = first + tl.arange(0, HEADS)[:, None]  # [HEADS, 1], of the H + KVH heads
        half = tl.arange(0, HD // 2)
        every = (head >= 0) & (half[None, :] < HD // 2)  # all true: a mask of the tile's shape for _load_input
        base = n * stride_qkv + head * HD + half[None, :]
        x1 = _load_input(QKV, base, every, split_stride, SPLITS, Q)
        x2 = _load_input(QKV, base + HD // 2, every, split_stride, SPLITS, Q)
        p = tl.load(ROPE_POS + n)
        c = tl.load(COS + p * HD + half).to(tl.float32)
        s = tl.load(SIN + p * HD + half).to(tl.float32)
        if first < H:
            o1, o2 = _norm_rope(x1, x2, QW, c, s, half, eps, HD, Q)
            out = Q + (n * H + head) * HD + half[None, :]
            tl.store(out, o1)
            tl.store(out + HD // 2, o2)
        else:
            o1, o2 = _norm_rope(x1, x2, KW, c, s, half, eps, HD, Q)
            kvh = head - H
            slot, wp = tl.load(SLOT + n).to(tl.int64), tl.load(WRITE_POS + n)
            at = slot * stride_cs + kvh * stride_ch + wp * stride_cl
            full = tl.arange(0, HD)[None, :]
            v = _load_input(QKV, n * stride_qkv + (H + KVH + kvh) * HD + full, (kvh >= 0) & (full < HD), split_stride,
                            SPLITS, Q).to(Q.dtype.element_ty)
            if INT8:
                scale_at = slot * stride_ss + kvh * stride_sh + wp
                k = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), [HEADS, HD])  # the halves side by side
                _store_int8(k.to(tl.float32), K_CACHE, at, K_SCALE, scale_at, HD)
                _store_int8(v.to(tl.float32), V_CACHE, at, V_SCALE, scale_at, HD)
            else:
                tl.store(K_CACHE + at + half[None, :], o1)
                tl.store(K_CACHE + at + HD // 2 + half[None, :], o2)
                tl.store(V_CACHE + at + full, v)

    @triton.jit
    def _store_int8(x, WORDS, at, SCALES, scale_at, HD: tl.constexpr):
        # vectors x (float32 [rows, HD]) into an int8 cache as kv_int8.quantize stores them, bit for bit: their
        # packed words at WORDS + at + [0, HD / 4), their scales at SCALES + scale_at (at, scale_at: [rows, 1])
        QD: tl.constexpr = HD // 4
        absmax = tl.max(tl.abs(x), axis=1)
        inv = tl.where(absmax > 0, tl.math.div_rn(tl.full(absmax.shape, 127.0, tl.float32), absmax), 0.0)
        y = x * inv[:, None]
        q = (y + tl.where(y >= 0, 0.5, -0.5)).to(tl.int32)  # converted toward zero: rounded half away from it
        q = tl.minimum(tl.maximum(q, -127), 127) & 0xFF
        shift = 8 * tl.arange(0, 4)
        words = tl.sum(tl.reshape(q, [x.shape[0], 4, QD]) << shift[None, :, None], axis=1)  # disjoint bytes: an or
        tl.store(WORDS + at + tl.arange(0, QD)[None, :], words)
        tl.store(SCALES + scale_at, tl.math.div_rn(absmax, tl.full(absmax.shape, 127.0, tl.float32))[:, None])

    @triton.jit
    def _decode_attention_kernel(
        Q, K, V, OUT, POS, stride_cs, stride_ch, stride_cl, scale,
        H: tl.constexpr, G: tl.constexpr, G_BLOCK: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # program (row b, kv head): the G query heads sharing that KV head attend over positions 0 .. POS[b] of slot b
        # (a padding row, POS < 0, attends to position 0 only). The G heads are padded to a G_BLOCK >= 16 tile so
        # both products run on tensor cores; online softmax in float32, as flash attention does.
        _await_inputs(PDL)
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        g = tl.arange(0, G_BLOCK)
        d = tl.arange(0, HD)
        gmask = g < G
        heads = kvh * G + g
        q = tl.load(Q + (b * H + heads[:, None]) * HD + d[None, :], mask=gmask[:, None], other=0.0)
        qk_scale = scale * 1.4426950408889634  # exp2 domain
        n_keys = tl.maximum(tl.load(POS + b), 0) + 1
        base = b * stride_cs + kvh * stride_ch
        m = tl.full([G_BLOCK], float("-inf"), tl.float32)
        l = tl.zeros([G_BLOCK], tl.float32)
        acc = tl.zeros([G_BLOCK, HD], tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            kmask = keys < n_keys
            offs = base + keys[:, None] * stride_cl + d[None, :]
            k = tl.load(K + offs, mask=kmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # [G_BLOCK, BLOCK_N]
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            v = tl.load(V + offs, mask=kmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / l[:, None]
        tl.store(OUT + (b * H + heads[:, None]) * HD + d[None, :], out.to(OUT.dtype.element_ty), mask=gmask[:, None])

    @triton.jit
    def _prefill_tile(T, G: tl.constexpr, G_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
        # a prefill attention program's sequence b, KV head and tile rows: (token t, query head g of the KV head)
        # pairs, and which of them are real
        r = tl.arange(0, BLOCK_M * G_BLOCK)
        t = tl.program_id(1) * BLOCK_M + r // G_BLOCK
        g = r % G_BLOCK
        return tl.program_id(0).to(tl.int64), tl.program_id(2), t, g, (t < T) & (g < G)

    @triton.jit
    def _prefill_attention_kernel(
        Q, K, V, OUT, SLOTS, STARTS, LENGTHS, T, stride_cs, stride_ch, stride_cl, scale,
        H: tl.constexpr, G: tl.constexpr, G_BLOCK: tl.constexpr, HD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):
        # program (sequence b, block of BLOCK_M of its new tokens, kv head): token t (at position starts[b] + t)
        # attends over positions 0 .. its own of slot slots[b], whose K/V (cached prefix and the new tokens) are
        # already in the cache. Tile rows are (token, query head of this KV head) pairs. A padded token
        # (t >= lengths[b]) attends to position 0 only. Keys past a row's position get exactly zero weight, so a row
        # does not depend on the other rows of its tile: a sequence's result does not depend on its batch.
        _await_inputs(PDL)
        b, kvh, t, g, rmask = _prefill_tile(T, G, G_BLOCK, BLOCK_M)
        d = tl.arange(0, HD)
        q_rows = ((b * T + t) * H + kvh * G + g) * HD
        q = tl.load(Q + q_rows[:, None] + d[None, :], mask=rmask[:, None], other=0.0)
        qk_scale = scale * 1.4426950408889634  # exp2 domain
        start, length = tl.load(STARTS + b), tl.load(LENGTHS + b)
        n_keys = tl.where(t < length, start + t, 0) + 1  # per row
        tile_keys = tl.max(tl.where(rmask, n_keys, 0), axis=0)
        base = tl.load(SLOTS + b).to(tl.int64) * stride_cs + kvh * stride_ch
        m = tl.full([BLOCK_M * G_BLOCK], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M * G_BLOCK], tl.float32)
        acc = tl.zeros([BLOCK_M * G_BLOCK, HD], tl.float32)
        for key0 in range(0, tile_keys, BLOCK_N):
            keys = key0 + tl.arange(0, BLOCK_N)
            offs = base + keys[:, None] * stride_cl + d[None, :]
            kmask = keys < tile_keys
            k = tl.load(K + offs, mask=kmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(keys[None, :] < n_keys[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            v = tl.load(V + offs, mask=kmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / l[:, None]
        tl.store(OUT + q_rows[:, None] + d[None, :], out.to(OUT.dtype.element_ty), mask=rmask[:, None])

    @triton.jit
    def _silu_mul_kernel(GU, OUT, S, I, BLOCK: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
        # [N, 2I] gate|up -> [N, I] silu(gate) * up, rounded after the silu as F.silu(gate) * up is, to gate|up's
        # dtype; FP8: a program holds a whole row (BLOCK >= I) and stores it as e4m3, its scale in S
        _await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        gate = tl.load(GU + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(GU + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
        dt = GU.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        y = (act * up).to(dt)
        if FP8:
            _store_e4m3(y.to(tl.float32), OUT, S, row, cols, mask, I)
        else:
            tl.store(OUT + row * I + cols, y, mask=mask)


    @triton.jit
    def _layer_norm_kernel(X, W, B, Y, S, D, eps, FP8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # one row: (x - mean) / sqrt(var + eps) * w + b in float32, rounded once to X's dtype as F.layer_norm rounds
        # (the encoder's LayerNorms); FP8: that row stored as e4m3, its scale in S
        _await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        centred = tl.where(mask, x - tl.sum(x, axis=0) / D, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / D + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        y = (centred * rstd * w + b).to(X.dtype.element_ty)
        if FP8:
            _store_e4m3(y.to(tl.float32), Y, S, row, cols, mask, D)
        else:
            tl.store(Y + row * D + cols, y, mask=mask)

    @triton.jit
    def _gelu_kernel(X, Y, S, D, FP8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # one row: x * (1 + erf(x / sqrt(2))) / 2 (F.gelu's exact form) in float32, rounded to X's dtype; FP8: that
        # row stored as e4m3, its scale in S
        _await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        y = (0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))).to(X.dtype.element_ty)
        if FP8:
            _store_e4m3(y.to(tl.float32), Y, S, row, cols, mask, D)
        else:
            tl.store(Y + row * D + cols, y, mask=mask)

    @triton.jit
    def _first_max(VALUES, INDEX, W, BLOCK: tl.constexpr):
        # the greedy token of one row from W block maxima (gemv's lm_head: VALUES[j] the largest logit of column
        # block j, INDEX[j] its first column, NaN for a block holding a NaN), as torch.argmax picks it: a NaN first,
        # else the largest value, a tie to the lowest column (blocks are in column order; W >= 1)
        big = 2147483647  # int32 max: "no column"
        best_v = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], big, tl.int32)
        nan_i = tl.full([], big, tl.int32)
        for start in range(0, W, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < W
            v = tl.load(VALUES + offs, mask=m, other=float("-inf"))
            i = tl.load(INDEX + offs, mask=m, other=big)
            is_nan = v != v
            nan_i = tl.minimum(nan_i, tl.min(tl.where(is_nan, i, big), axis=0))
            v = tl.where(is_nan, float("-inf"), v)
            top = tl.max(v, axis=0)
            first = tl.min(tl.where(m & (v == top), i, big), axis=0)
            take = (top > best_v) | (best_i == big)  # an equal maximum in a later block loses: its columns are higher
            best_i = tl.where(take, first, best_i)
            best_v = tl.where(take, top, best_v)
        return tl.where(nan_i < big, nan_i, best_i).to(tl.int64)

    @triton.jit
    def _advance_rows_kernel(NXT, VALUES, TOKENS, POSITIONS, COUNTS, BUDGETS, EOS, OUT, W, stride_out,
                             MAXIMA: tl.constexpr, NUM_EOS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # the decode step's bookkeeping for row b (see advance_rows); its token NXT[b], or with MAXIMA the first
        # argmax of its W block maxima (VALUES, NXT [B, W])
        _await_inputs(PDL)
        b = tl.program_id(0).to(tl.int64)
        if MAXIMA:
            nxt = _first_max(VALUES + b * W, NXT + b * W, W, BLOCK)
        else:
            nxt = tl.load(NXT + b)
        pos = tl.load(POSITIONS + b)
        live = pos >= 0
        counts = tl.load(COUNTS + b) + live.to(tl.int64)
        stop = counts >= tl.load(BUDGETS + b)
        for e in tl.static_range(NUM_EOS):
            stop = stop | (nxt == tl.load(EOS + e))
        finished = live & stop
        tl.store(OUT + b, tl.where(live, nxt, -1))
        tl.store(OUT + stride_out + b, finished.to(tl.int64))
        tl.store(TOKENS + b, tl.where(live, nxt, tl.load(TOKENS + b)))
        tl.store(POSITIONS + b, tl.where(live & ~finished, pos + 1, -1))
        tl.store(COUNTS + b, counts)


@dataclass(frozen=True)
class BlockMaxima:
    """Each row's greedy token, not yet reduced: gemv.linear_argmax's lm_head leaves, per row and block of output
    columns, the block's largest logit (float32, exactly the rounded logit; NaN where the block holds one) and its
    first column. advance_rows reduces them to the token torch.argmax would pick, in the same launch as the
    bookkeeping. values: float32 [B, W]; index: int32 [B, W]."""

    values: torch.Tensor
    index: torch.Tensor


def pdl_options(device: torch.device, rows: int) -> dict:
    """The launch arguments of a kernel here or in gemv.py over `rows` rows (tokens): its PDL constexpr and Triton's
    launch_pdl, both on (use_pdl, and at most PDL_MAX_ROWS rows) or both off."""
    on = rows <= PDL_MAX_ROWS and use_pdl(device)
    return {"PDL": on, "launch_pdl": on}


def _splits(x: torch.Tensor, dtype: torch.dtype) -> int:
    """0 for a plain input of `dtype` [N, W]; S for float32 split-K partial sums [S, N, W] (gemv.partial_products)."""
    if x.dim() == 3 and x.dtype == torch.float32:
        return x.shape[0]
    if x.dim() == 2 and x.dtype == dtype:
        return 0
    raise ValueError(f"expected [N, W] {dtype} or float32 partial sums [S, N, W], got {tuple(x.shape)} {x.dtype}")


# Rows up to which a norm kernel (one program a row) takes a warp per 64 columns (16, the cap, at the 0.6B and 1.7B
# widths) rather than one per 256: the decode step's small buckets, the rows its products run on gemv.py's split-K
# kernels (gemv.DEFAULT_MAX_ROWS), where the norm after o_proj or down sums 8-16 float32 partial rows and the more loads
# in flight the sooner it ends. On the H200 (session 17, alternating on one lease) the 0.6B step went 0.877 -> 0.818 ms
# at one row and 1.213 -> 1.147 at 32 (1.7B: 1.446 -> 1.388 at one row); over a prefill's thousands of rows 16 a row
# cost 7% of offline throughput, so above this the old rule stays.
NORM_WIDE_ROWS = 32


def norm_warps(rows: int, block: int) -> int:
    """Warps of a one-row-a-program norm kernel over `rows` rows of `block` (a power of two) columns."""
    return min(16, max(1, block // (64 if rows <= NORM_WIDE_ROWS else 256)))


def _rows_out(N: int, D: int, dtype: torch.dtype, device, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A row kernel's output [N, D]: (rows of `dtype`, the same tensor again for its unused scale argument), or with
    fp8 (e4m3 rows, their float32 scales [N, 1])."""
    y = torch.empty((N, D), dtype=torch.float8_e4m3fn if fp8 else dtype, device=device)
    return y, torch.empty((N, 1), dtype=torch.float32, device=device) if fp8 else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             fp8: bool = False):
    """norm(x) * weight over the last dim; with `residual`: residual += x first (in place) and norm that.

    x: contiguous [N, D], or the float32 partial sums [S, N, D] of a split product (summed and rounded to the
    residual's dtype first); residual: contiguous [N, D] -> [N, D]. fp8: -> (e4m3 [N, D], float32 scales [N, 1]),
    the result rounded to the weight's dtype and quantized a row at a time as fp8.quantize_rows does.
    """
    dtype = residual.dtype if residual is not None else weight.dtype if x.dim() == 3 else x.dtype
    splits = _splits(x, dtype)
    N, D = x.shape[-2:]
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    y, scales = _rows_out(N, D, dtype, x.device, fp8)
    block = triton.next_power_of_2(D)
    _rms_norm_kernel[(N,)](x, residual if residual is not None else x, weight, y, scales, D, eps, N * D,
                           SPLITS=splits, HAS_RESIDUAL=residual is not None, FP8=fp8, BLOCK=block,
                           num_warps=norm_warps(N, block), **pdl_options(x.device, N))
    return (y, scales) if fp8 else y


QK_HEADS_MAX = 8  # heads per program of qk_norm_rope_store past QK_ONE_HEAD_TOKENS tokens
QK_ONE_HEAD_TOKENS = 32


def qk_heads_per_program(num_heads: int, num_kv_heads: int, tokens: int) -> int:
    """Heads one program of qk_norm_rope_store takes: one a program for a few tokens (a small decode step: more
    programs run at once; the H200 measured 1 head at 5.7 us a call at 1 row, all 24 in one program 6.6 us), up to
    QK_HEADS_MAX dividing both head counts past that (a prefill of ~500 tokens as one-head programs queued in waves:
    14.6 us a call; 256 rows: 5.0 us as one-head programs, 2.9 us as one program a token)."""
    if tokens <= QK_ONE_HEAD_TOKENS:
        return 1
    shared = math.gcd(num_heads, num_kv_heads, QK_HEADS_MAX)
    return shared & -shared  # its largest power-of-two divisor: tl.arange needs one


def qk_norm_rope_store(qkv, q_weight, k_weight, cos, sin, rope_pos, slots, write_pos, k_cache, v_cache,
                       num_heads: int, num_kv_heads: int, eps: float,
                       scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The attention's input side in one kernel.

    qkv: [N, (H + 2 KVH) hd] projections of N tokens (or their float32 split-K partial sums [S, N, ...], summed and
    rounded to the weights' dtype first); cos/sin: [P, hd] tables; rope_pos, slots, write_pos: [N].
    Writes each token's normed, rotated key and its value into k_cache/v_cache [S, KVH, L, hd] at
    [slots[n], :, write_pos[n]] and returns the normed, rotated queries [N, H, hd]. With `scales` (the key and value
    scales [S, KVH, L] of an int8 cache, kv_int8) the caches are int32 words [S, KVH, L, hd / 4] and the vectors are
    stored quantized.
    """
    dtype = q_weight.dtype
    splits = _splits(qkv, dtype)
    N = qkv.shape[-2]
    hd = q_weight.shape[0]
    # the kernel indexes these as plain [N] arrays: an expanded index tensor (stride 0) would be read past its end
    rope_pos, slots, write_pos = rope_pos.contiguous(), slots.contiguous(), write_pos.contiguous()
    assert qkv.stride(-1) == 1 and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert not splits or qkv.is_contiguous()
    k_scale, v_scale = scales if scales is not None else (k_cache, v_cache)
    assert (scales is None and k_cache.dtype == dtype) or (
        k_cache.dtype == torch.int32 and k_cache.shape[-1] == hd // 4 and k_scale.stride() == v_scale.stride()
        and k_scale.stride(-1) == 1)
    q = torch.empty((N, num_heads, hd), dtype=dtype, device=qkv.device)
    sc, sh, sl, _ = k_cache.stride()
    heads = qk_heads_per_program(num_heads, num_kv_heads, N)
    _qk_norm_rope_store_kernel[(N, (num_heads + num_kv_heads) // heads)](
        qkv, q, k_cache, v_cache, k_scale, v_scale, q_weight, k_weight, cos, sin, rope_pos, slots, write_pos,
        qkv.stride(-2), sc, sh, sl, k_scale.stride(0), k_scale.stride(1), eps, N * qkv.shape[-1], H=num_heads,
        KVH=num_kv_heads, HD=hd, HEADS=heads, SPLITS=splits, INT8=scales is not None, num_warps=max(1, heads // 2),
        **pdl_options(qkv.device, N))
    return q


# a decode attention program's tile: keys per iteration, warps, pipeline stages. In graphs on the H200 at the 0.6B
# heads, rows at position 200 (`python -m qasr.bench.kernel_check --sections decode_tiles`, session 15): 128 x 4 x 2
# took 4.65 / 9.27 / 55.9 us at 1 / 32 / 256 rows against 5.55 / 9.64 / 57.3 with 64 x 4 x 3, the best of 8 tiles at 1
# and 256 rows (at 32 three were faster, the best 64 x 4 x 4 at 8.66); in the step 1.3-3.9% faster from 64 rows
DECODE_TILE = (128, 4, 2)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Row b (= slot b) attends over cache positions 0 .. positions[b] (position 0 only when it is -1).

    q: [B, H, hd]; caches [S >= B, KVH, L, hd]; positions: [B] -> [B, H * hd]. Reads only the live keys of each row.
    tile: (keys an iteration, warps, stages), default DECODE_TILE; fixed, never chosen per batch (another tile may
    round a row differently).
    """
    B, H, hd = q.shape
    kvh = k_cache.shape[1]
    q, positions = q.contiguous(), positions.contiguous()
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    group = H // kvh
    out = torch.empty((B, H * hd), dtype=q.dtype, device=q.device)
    sc, sh, sl, _ = k_cache.stride()
    keys, warps, stages = tile or DECODE_TILE
    _decode_attention_kernel[(B, kvh)](
        q, k_cache, v_cache, out, positions, sc, sh, sl, 1.0 / math.sqrt(hd),
        H=H, G=group, G_BLOCK=max(16, triton.next_power_of_2(group)), HD=hd, BLOCK_N=keys, num_warps=warps,
        num_stages=stages, **pdl_options(q.device, B))
    return out


# (token, query head) rows of a prefill attention program, and its warps: in a graph on the H200 at the 0.6B heads
# (`python -m qasr.bench.prefill_cost --sections attention`, session 14) 64 x 4 took 12.8 us for 8 sequences of 152
# tokens and 37.2 for 32, against 16.9 and 52.8 with 32 x 4 (128 x 8: 16.4 and 47.9; 128 x 4: 26.5 and 80.7)
PREFILL_TILE_ROWS = 64
PREFILL_WARPS = 4


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      starts: torch.Tensor, lengths: torch.Tensor, tile_rows: int | None = None,
                      num_warps: int | None = None) -> torch.Tensor:
    """Causal attention of new tokens over their slot's cache (the cached prefix and the new tokens' own K/V).

    q: [B * T, H, hd], row b * T + t = token t of sequence b, at position starts[b] + t of slot slots[b] (valid for
    t < lengths[b]); caches [S, KVH, L, hd] -> [B * T, H * hd]. tile_rows, num_warps: a program's (token, query
    head) rows and warps (default PREFILL_TILE_ROWS, PREFILL_WARPS; bench.prefill_cost compares them). A row's
    result does not depend on the other rows of its tile, but another tile shape may round it differently on a GPU
    (the tensor-core instructions follow the tile; seen on the H200), so the tile is fixed, never chosen per batch.
    """
    B = slots.shape[0]
    N, H, hd = q.shape
    T = N // B
    kvh = k_cache.shape[1]
    group = H // kvh
    q, slots, starts, lengths = q.contiguous(), slots.contiguous(), starts.contiguous(), lengths.contiguous()
    assert N == B * T and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty((N, H * hd), dtype=q.dtype, device=q.device)
    sc, sh, sl, _ = k_cache.stride()
    g_block = triton.next_power_of_2(group)
    block_m = max(1, (tile_rows or PREFILL_TILE_ROWS) // g_block)  # tokens a program
    _prefill_attention_kernel[(B, triton.cdiv(T, block_m), kvh)](
        q, k_cache, v_cache, out, slots, starts, lengths, T, sc, sh, sl, 1.0 / math.sqrt(hd),
        H=H, G=group, G_BLOCK=g_block, HD=hd, BLOCK_M=block_m, BLOCK_N=64, num_warps=num_warps or PREFILL_WARPS,
        **pdl_options(q.device, N))
    return out


def silu_mul(gate_up: torch.Tensor, fp8: bool = False):
    """[N, 2I] -> [N, I]: silu(gate) * up; fp8: -> (e4m3 [N, I], float32 scales [N, 1]) as fp8.quantize_rows."""
    N, two_i = gate_up.shape
    assert gate_up.is_contiguous()
    I = two_i // 2
    out, scales = _rows_out(N, I, gate_up.dtype, gate_up.device, fp8)
    block = triton.next_power_of_2(I) if fp8 else 1024  # FP8: a row's scale needs the whole row in one program
    _silu_mul_kernel[(N, triton.cdiv(I, block))](gate_up, out, scales, I, BLOCK=block, FP8=fp8,
                                                 num_warps=min(16, block // 256) if fp8 else 4,
                                                 **pdl_options(gate_up.device, N))
    return (out, scales) if fp8 else out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, fp8: bool = False):
    """F.layer_norm over the last dim of contiguous [N, D] x (the encoder's); fp8: -> (e4m3 [N, D], float32 scales
    [N, 1]), the result quantized a row at a time as fp8.quantize_rows does."""
    assert x.is_contiguous() and x.dim() == 2
    y, scales = _rows_out(*x.shape, x.dtype, x.device, fp8)
    block = triton.next_power_of_2(x.shape[1])
    _layer_norm_kernel[(x.shape[0],)](x, weight, bias, y, scales, x.shape[1], eps, FP8=fp8, BLOCK=block,
                                      num_warps=norm_warps(x.shape[0], block), **pdl_options(x.device, x.shape[0]))
    return (y, scales) if fp8 else y


def gelu(x: torch.Tensor, fp8: bool = False):
    """F.gelu (exact) of contiguous [N, D] x; fp8: -> (e4m3 [N, D], float32 scales [N, 1]) as fp8.quantize_rows."""
    assert x.is_contiguous() and x.dim() == 2
    y, scales = _rows_out(*x.shape, x.dtype, x.device, fp8)
    block = triton.next_power_of_2(x.shape[1])  # a whole row a program: its scale needs all of it
    _gelu_kernel[(x.shape[0],)](x, y, scales, x.shape[1], FP8=fp8, BLOCK=block,
                                num_warps=min(16, max(1, block // 256)), **pdl_options(x.device, x.shape[0]))
    return (y, scales) if fp8 else y


def decode_begin(tokens: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, scratch: int) -> tuple[torch.Tensor, ...]:
    """The decode step's start in one launch (TextDecoder.decode's embedding lookup and position arithmetic, and
    FusedLayerOps.begin's residual copy and first RMSNorm, which it must equal bit for bit).

    tokens, positions: [B] long (position -1: a padding or idle row); embed: the token table [V, D]; norm_weight: the
    first layer's input RMSNorm [D] -> (its output h [B, D], the residual stream [B, D] (the tokens' embeddings),
    rope_pos [B] (the position, 0 for -1), slots [B] (= 0 .. B-1), write_pos [B] (the position, `scratch` for -1)).
    """
    B = tokens.shape[0]
    V, D = embed.shape
    assert tokens.dtype == positions.dtype == torch.long and tokens.is_contiguous() and positions.is_contiguous()
    assert embed.is_contiguous()
    h = torch.empty((B, D), dtype=embed.dtype, device=embed.device)
    residual = torch.empty_like(h)
    rope_pos, slots, write_pos = (torch.empty(B, dtype=torch.long, device=embed.device) for _ in range(3))
    block = triton.next_power_of_2(D)
    _decode_begin_kernel[(B,)](tokens, positions, embed, norm_weight, h, residual, rope_pos, slots, write_pos, D, V,
                               scratch, eps, BLOCK=block, num_warps=norm_warps(B, block),
                               **pdl_options(embed.device, B))
    return h, residual, rope_pos, slots, write_pos


# the argmax of a row's lm_head block maxima in advance_rows: one program a row takes up to ARGMAX_BLOCK of them an
# iteration with ARGMAX_WARPS warps (the 0.6B and 1.7B lm_heads leave 2,374 at 64 columns a block: one iteration)
ARGMAX_BLOCK = 4096
ARGMAX_WARPS = 16


def advance_rows(next_tokens: torch.Tensor | BlockMaxima, tokens: torch.Tensor, positions: torch.Tensor,
                 counts: torch.Tensor, budgets: torch.Tensor, eos: torch.Tensor, out: torch.Tensor) -> None:
    """The decode step's per-row bookkeeping in one launch, in place (the ~18 small PyTorch ops of
    runner.advance_rows, which it must equal): for rows b < B = len(next_tokens), a live row (positions[b] >= 0)
    counts its token, finishes on an EOS id or its budget; out[0, b] = its token or -1, out[1, b] = finished;
    tokens[b] takes the token, positions[b] moves on by one or goes idle (-1).

    next_tokens: [B] long, or the lm_head's BlockMaxima [B, W] (the argmax is then taken here, as torch.argmax
    would: no launch of its own); tokens, positions, counts, budgets: [S >= B] long; eos: [E] long; out: [2, S] long.
    """
    maxima = isinstance(next_tokens, BlockMaxima)
    nxt, values = (next_tokens.index, next_tokens.values) if maxima else (next_tokens, next_tokens)
    B = nxt.shape[0]
    W = nxt.shape[1] if maxima else 1
    assert nxt.is_contiguous() and (not maxima or (values.dtype == torch.float32 and values.shape == nxt.shape
                                                   and values.is_contiguous() and nxt.dtype == torch.int32))
    for t in (*([] if maxima else [nxt]), tokens, positions, counts, budgets, eos, out):
        assert t.dtype == torch.long and t.is_contiguous()
    _advance_rows_kernel[(B,)](nxt, values, tokens, positions, counts, budgets, eos, out, W, out.stride(0),
                               MAXIMA=maxima, NUM_EOS=eos.shape[0], BLOCK=min(ARGMAX_BLOCK, triton.next_power_of_2(W)),
                               num_warps=ARGMAX_WARPS if maxima else 1, **pdl_options(out.device, B))
