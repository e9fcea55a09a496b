"""The int8 KV cache's format, in PyTorch: what the fused kernels write and read (kernels.py), and how the plain path
stores and reads the same cache.

Each key and value vector (one token, one KV head, hd values) is stored as hd int8 values and one float32 scale, its
absmax / 127: x ~ q * scale, q = x * (127 / absmax) rounded half away from zero. The int8 values are packed into
hd / 4 32-bit words, byte j (the lowest first) of word w holding dimension j * hd/4 + w: a kernel loads a key's words
as a bf16 key's halves would be loaded (16 bytes at a time) and takes them apart into four [keys, hd/4] quarters in
registers, instead of moving an 8-bit tile through shared memory a byte at a time (what made sessions 10 and 21's int8
and FP8 caches slower than bf16: docs/benchmarks.md).
"""

from __future__ import annotations

import math

import torch

QMAX = 127


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., hd] -> (int32 words [..., hd / 4], float32 scales [...]). An all-zero vector gets scale 0 and zeros."""
    x = x.float()
    absmax = x.abs().amax(-1)
    qmax = torch.full_like(absmax, QMAX)  # tensor / tensor: a division rounded once on every device (PyTorch's CUDA
    # kernels multiply by a Python scalar's reciprocal instead)
    inv = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))
    y = x * inv[..., None]
    q = torch.trunc(y + torch.copysign(torch.full_like(y, 0.5), y)).clamp(-QMAX, QMAX).to(torch.int8)
    hd = x.shape[-1]
    packed = q.unflatten(-1, (4, hd // 4)).transpose(-1, -2).contiguous()  # [..., w, j]
    return packed.flatten(-2).view(torch.int32), absmax / qmax


def unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., hd / 4] -> the int8 values [..., hd] in dimension order."""
    return words.contiguous().view(torch.int8).unflatten(-1, (-1, 4)).transpose(-1, -2).flatten(-2)


def dequantize(words: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize's (words, scales) -> the vectors they stand for, [..., hd] in dtype."""
    return (unpack(words).float() * scales[..., None]).to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# The attention kernels' int8 readers: kernels.decode_attention and kernels.prefill_attention over this format (the
# writer is kernels.qk_norm_rope_store's INT8 branch). A key's scale multiplies its scores after the product; a
# value's scale its softmax weights before the second product. Each product is the sum of its four quarters'.

from .kernels import PREFILL_TILE_ROWS, PREFILL_WARPS, _await_inputs, _prefill_tile, pdl_options, triton  # noqa: E402

# the int8 decode attention's tile: keys an iteration, warps, stages (fixed, as kernels.DECODE_TILE: another tile
# may round a row differently). On an H100 (session 31, 28 layer caches, rows at 200 positions) 128 x 4 x 2 took
# 6.4 / 13.8 / 58.4 / 107.6 us at 1 / 32 / 256 / 512 rows, 32 x 4 x 3 8.2 / 11.3 / 54.6 / 99.5: the one-row best of
# the five tried, the step measured with it; 32 x 4 x 3 in the step is still to be measured
DECODE_TILE = (128, 4, 2)
# the int8 prefill attention's tile: (token x query-head) rows a program, warps, stages. kernels.prefill_attention's
# rows and warps at Triton's three stages. There it spills registers on sm_90 (105 local stores, 66 KB of shared
# memory; at one stage none, 32 KB), and is still the faster: on an H100 (session 35, kernel_check --sections kv_int8)
# 49.0 us a layer's call at three stages, 56.3 at two, 64.3 at one (bf16's kernel 38.4)
PREFILL_TILE = (PREFILL_TILE_ROWS, PREFILL_WARPS, 3)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _quarters(words, DT: tl.constexpr):
        # int32 words [N, HD / 4] -> their four bytes as signed integers in DT (exact: |q| <= 127), byte 0 first.
        # No int-to-float conversion: an I2F per byte (by the CUDA guide 16 a clock an SM, a quarter of 32-bit
        # integer logic's rate) was the most frequent costly instruction in the decode reader's sm_90 SASS. The byte
        # offset to u = q + 128 in [1, 255] becomes the low mantissa of the float 2^23 (bits 0x4B000000 | u stand for
        # 2^23 + u), and 2^23 + 128 is subtracted: q, exactly, so the readers' results do not change
        u = words ^ -0x7F7F7F80  # each byte's top bit flipped (0x80808080 as an int32): q + 128
        b0 = _exact_byte(u & 0xFF, DT)
        b1 = _exact_byte((u >> 8) & 0xFF, DT)
        b2 = _exact_byte((u >> 16) & 0xFF, DT)
        b3 = _exact_byte((u >> 24) & 0xFF, DT)
        return b0, b1, b2, b3

    @triton.jit
    def _exact_byte(u, DT: tl.constexpr):
        # u = q + 128 in [0, 255] (int32) -> q in DT
        q = (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        if DT == tl.bfloat16:  # an integer of at most 8 bits: a float32's upper half is its bfloat16, exactly (no
            # float conversion either)
            return (q.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return q.to(DT)

    @triton.jit
    def _scores(q0, q1, q2, q3, K, offs, kmask, KS, scale_offs, qk_scale, DT: tl.constexpr):
        # [rows, keys] scores (exp2 domain) of the query quarters against the keys at offs (words) / scale_offs
        k0, k1, k2, k3 = _quarters(tl.load(K + offs, mask=kmask[:, None], other=0), DT)
        s = tl.dot(q0, tl.trans(k0))
        s = tl.dot(q1, tl.trans(k1), s)
        s = tl.dot(q2, tl.trans(k2), s)
        s = tl.dot(q3, tl.trans(k3), s)
        return s * (tl.load(KS + scale_offs, mask=kmask, other=0.0) * qk_scale)[None, :]

    @triton.jit
    def _load_quarters(X, at, mask, QD: tl.constexpr):
        # the four column quarters of a [rows, 4 QD] tile (at: [rows, QD] offsets of the first)
        return (tl.load(X + at, mask=mask, other=0.0), tl.load(X + at + QD, mask=mask, other=0.0),
                tl.load(X + at + 2 * QD, mask=mask, other=0.0), tl.load(X + at + 3 * QD, mask=mask, other=0.0))

    @triton.jit
    def _attend(s, m, l, a0, a1, a2, a3, V, offs, kmask, VS, scale_offs, DT: tl.constexpr):
        # one block of keys into the online softmax (float32, as flash attention does): its scores s (exp2 domain,
        # -inf where masked) update the running maximum m and sum l, its values the four quarters' accumulators
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        pv = (p * tl.load(VS + scale_offs, mask=kmask, other=0.0)[None, :]).to(DT)
        v0, v1, v2, v3 = _quarters(tl.load(V + offs, mask=kmask[:, None], other=0), DT)
        return (m_new, l * alpha + tl.sum(p, axis=1), tl.dot(pv, v0, a0 * alpha[:, None]),
                tl.dot(pv, v1, a1 * alpha[:, None]), tl.dot(pv, v2, a2 * alpha[:, None]),
                tl.dot(pv, v3, a3 * alpha[:, None]))

    @triton.jit
    def _store_quarters(OUT, at, a0, a1, a2, a3, l, mask, QD: tl.constexpr):
        DT: tl.constexpr = OUT.dtype.element_ty
        tl.store(OUT + at, (a0 / l[:, None]).to(DT), mask=mask)
        tl.store(OUT + at + QD, (a1 / l[:, None]).to(DT), mask=mask)
        tl.store(OUT + at + 2 * QD, (a2 / l[:, None]).to(DT), mask=mask)
        tl.store(OUT + at + 3 * QD, (a3 / l[:, None]).to(DT), mask=mask)

    @triton.jit
    def _decode_attention_int8_kernel(
        Q, K, V, KS, VS, OUT, POS, stride_cs, stride_ch, stride_cl, stride_ss, stride_sh, scale,
        H: tl.constexpr, G: tl.constexpr, G_BLOCK: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # kernels._decode_attention_kernel over an int8 cache
        _await_inputs(PDL)
        QD: tl.constexpr = HD // 4
        DT: tl.constexpr = Q.dtype.element_ty
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        g = tl.arange(0, G_BLOCK)
        w = tl.arange(0, QD)
        gmask = g[:, None] < G
        rows = (b * H + kvh * G + g[:, None]) * HD + w[None, :]
        q0, q1, q2, q3 = _load_quarters(Q, rows, gmask, QD)
        qk_scale = scale * 1.4426950408889634  # exp2 domain
        n_keys = tl.maximum(tl.load(POS + b), 0) + 1
        base = b * stride_cs + kvh * stride_ch
        scale_base = b * stride_ss + kvh * stride_sh
        m = tl.full([G_BLOCK], float("-inf"), tl.float32)
        l = tl.zeros([G_BLOCK], tl.float32)
        a0 = tl.zeros([G_BLOCK, QD], tl.float32)
        a1 = tl.zeros([G_BLOCK, QD], tl.float32)
        a2 = tl.zeros([G_BLOCK, QD], tl.float32)
        a3 = tl.zeros([G_BLOCK, QD], tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            kmask = keys < n_keys
            offs = base + keys[:, None] * stride_cl + w[None, :]
            s = _scores(q0, q1, q2, q3, K, offs, kmask, KS, scale_base + keys, qk_scale, DT)
            s = tl.where(kmask[None, :], s, float("-inf"))
            m, l, a0, a1, a2, a3 = _attend(s, m, l, a0, a1, a2, a3, V, offs, kmask, VS, scale_base + keys, DT)
        _store_quarters(OUT, rows, a0, a1, a2, a3, l, gmask, QD)

    @triton.jit
    def _prefill_attention_int8_kernel(
        Q, K, V, KS, VS, OUT, SLOTS, STARTS, LENGTHS, T, stride_cs, stride_ch, stride_cl, stride_ss, stride_sh, scale,
        H: tl.constexpr, G: tl.constexpr, G_BLOCK: tl.constexpr, HD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):
        # kernels._prefill_attention_kernel over an int8 cache
        _await_inputs(PDL)
        QD: tl.constexpr = HD // 4
        DT: tl.constexpr = Q.dtype.element_ty
        b, kvh, t, g, rmask = _prefill_tile(T, G, G_BLOCK, BLOCK_M)
        w = tl.arange(0, QD)
        rows = ((b * T + t) * H + kvh * G + g)[:, None] * HD + w[None, :]
        q0, q1, q2, q3 = _load_quarters(Q, rows, rmask[:, None], QD)
        qk_scale = scale * 1.4426950408889634  # exp2 domain
        start, length = tl.load(STARTS + b), tl.load(LENGTHS + b)
        n_keys = tl.where(t < length, start + t, 0) + 1  # per row
        tile_keys = tl.max(tl.where(rmask, n_keys, 0), axis=0)
        slot = tl.load(SLOTS + b).to(tl.int64)
        base = slot * stride_cs + kvh * stride_ch
        scale_base = slot * stride_ss + kvh * stride_sh
        m = tl.full([BLOCK_M * G_BLOCK], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M * G_BLOCK], tl.float32)
        a0 = tl.zeros([BLOCK_M * G_BLOCK, QD], tl.float32)
        a1 = tl.zeros([BLOCK_M * G_BLOCK, QD], tl.float32)
        a2 = tl.zeros([BLOCK_M * G_BLOCK, QD], tl.float32)
        a3 = tl.zeros([BLOCK_M * G_BLOCK, QD], tl.float32)
        for key0 in range(0, tile_keys, BLOCK_N):
            keys = key0 + tl.arange(0, BLOCK_N)
            kmask = keys < tile_keys
            offs = base + keys[:, None] * stride_cl + w[None, :]
            s = _scores(q0, q1, q2, q3, K, offs, kmask, KS, scale_base + keys, qk_scale, DT)
            s = tl.where(keys[None, :] < n_keys[:, None], s, float("-inf"))
            m, l, a0, a1, a2, a3 = _attend(s, m, l, a0, a1, a2, a3, V, offs, kmask, VS, scale_base + keys, DT)
        _store_quarters(OUT, rows, a0, a1, a2, a3, l, rmask[:, None], QD)


def _check(k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, ...]:
    """An int8 cache's strides (words, then scales), after checking the four tensors agree."""
    if k.is_cuda and k.shape[-1] < 16:  # a quarter is a tensor-core product's depth, at least 16 (the interpreter
        # takes any)
        raise ValueError(f"the int8 KV cache's kernels need head_dim >= 64, got {4 * k.shape[-1]}")
    k_scale, v_scale = scales
    assert k.dtype == v.dtype == torch.int32 and k.stride() == v.stride() and k.stride(-1) == 1
    assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.stride() == v_scale.stride()
    assert k_scale.shape == k.shape[:-1] and k_scale.stride(-1) == 1
    return (*k.stride()[:3], *k_scale.stride()[:2])


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor],
                     positions: torch.Tensor, tile: tuple[int, int, int] = DECODE_TILE) -> torch.Tensor:
    """kernels.decode_attention over an int8 cache: k, v [S, KVH, L, hd / 4] int32 words, scales (keys', values')
    [S, KVH, L] float32."""
    B, H, hd = q.shape
    kvh = k.shape[1]
    out = torch.empty((B, H * hd), dtype=q.dtype, device=q.device)
    keys, warps, stages = tile
    _decode_attention_int8_kernel[(B, kvh)](
        q.contiguous(), k, v, *scales, out, positions.contiguous(), *_check(k, v, scales), 1.0 / math.sqrt(hd),
        H=H, G=H // kvh, G_BLOCK=max(16, triton.next_power_of_2(H // kvh)), HD=hd, BLOCK_N=keys, num_warps=warps,
        num_stages=stages, **pdl_options(q.device, B))
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor],
                      slots: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                      tile: tuple[int, int, int] = PREFILL_TILE) -> torch.Tensor:
    """kernels.prefill_attention over an int8 cache (as decode_attention here); tile: PREFILL_TILE's kind."""
    B = slots.shape[0]
    N, H, hd = q.shape
    T = N // B
    kvh = k.shape[1]
    group = H // kvh
    assert N == B * T
    out = torch.empty((N, H * hd), dtype=q.dtype, device=q.device)
    tile_rows, warps, stages = tile
    g_block = triton.next_power_of_2(group)
    block_m = max(1, tile_rows // g_block)  # tokens a program
    _prefill_attention_int8_kernel[(B, triton.cdiv(T, block_m), kvh)](
        q.contiguous(), k, v, *scales, out, slots.contiguous(), starts.contiguous(), lengths.contiguous(), T,
        *_check(k, v, scales), 1.0 / math.sqrt(hd), H=H, G=group, G_BLOCK=g_block, HD=hd, BLOCK_M=block_m,
        BLOCK_N=64, num_warps=warps, num_stages=stages, **pdl_options(q.device, N))
    return out
