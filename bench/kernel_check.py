"""GPU check of the fused kernels at real shapes: each decoder kernel (and the encoder's first convolution,
conv_kernels.conv1_gelu) against the PyTorch reference in bf16, the small-batch GEMV kernels (model/gemv.py) against
cuBLAS (agreement, row independence across buckets, time), then the decode step on three paths (plain PyTorch, fused
kernels with cuBLAS products, fused with GEMV: graph replay time, kernels per step) and the encoder graphs against
eager.

First, programmatic dependent launch (#16, $QASR_PDL): one runner's decode step captured twice in one process, with
QASR_PDL=0 and =1, timed at each bucket (graph replay), its logits compared bit for bit between the two, and its
kernels per step counted by kind (Triton, whose launches PDL can overlap, and the rest: cuBLAS, PyTorch, copies).
Run the whole check with QASR_PDL=1 and every kernel comparison after it runs with PDL on too.

`decode_tiles` times the decode attention's tiles (kernels.DECODE_TILE against others) in graphs. `kv_int8` checks
the int8 KV cache's kernels (model/kv_int8.py: the writer against kv_int8.quantize, the readers against the bf16
kernels over the dequantized cache) and times its decode attention against the bf16 one, each call reading its own
layer's cache from memory as a step does. `fp8` checks FP8 prefill's kernels (model/fp8.py: the RMSNorm and
SiLU*mul that quantize for the products, bit for bit against fp8.quantize_rows of the bf16 kernels' output, and the
products against bf16's) and times a layer's prefill products with their norms, bf16 against FP8. `fp8_lm_head`
rounds the decode-step products' weights that _gemv_kernel multiplies (qkv, o_proj, down, the lm_head) to FP8 as
model/fp8_lm_head.py rounds the lm_head's: each FP8 GEMV against the bf16 GEMV over its image (bit for bit, the same
config), both timed streaming from memory; then the decode step with the lm_head rounded against the step on the
model's own in alternating rounds, and how often a greedy token changes.

`python -m qasr.bench.kernel_check [0.6B|1.7B] [--sections pdl,kernels,gemv,decode_tiles,kv_int8,fp8,fp8_lm_head,steps]`
on a CUDA
machine;
prints one JSON object per line, a section each, as each completes (so a time limit leaves the sections that
finished).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from types import SimpleNamespace
from unittest import mock

import torch
import torch.nn.functional as F

from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.runner import ModelRunner, capture_graph, capture_stream
from qasr.model import fp8, fp8_lm_head, gemv, kernels, kv_int8
from qasr.model.conv_kernels import conv1_gelu
from qasr.model.gpu_timing import per_call_ms, replay_ms
from qasr.model.modeling import RMSNorm, rotate_half
from qasr.model.testmodel import make_test_model

from .cli import OFFLINE_MAX_LEN
from .offline import kernels_per_step, profiled

SECTIONS = ("pdl", "kernels", "gemv", "decode_tiles", "kv_int8", "fp8", "fp8_lm_head", "steps")
KV_INT8_TILES = tuple(dict.fromkeys((kv_int8.DECODE_TILE, (128, 4, 2), (32, 4, 3), (32, 4, 2), (64, 4, 2), (256, 4, 1),
                                     (256, 8, 1), (128, 4, 1), (16, 4, 3))))
KV_INT8_PREFILL_TILES = tuple(dict.fromkeys((kv_int8.PREFILL_TILE, (64, 4, 3), (64, 4, 2), (128, 4, 1), (128, 8, 1),
                                             (32, 4, 1))))  # (token x query-head) rows a program, warps, stages
# the default first; 256 keys x 3 stages needs more shared memory than an H200 has
# (256 keys: a 10.9 s clip's prompt and its tokens, ~190 positions, in one iteration)
DECODE_TILES = tuple(dict.fromkeys((kernels.DECODE_TILE, (64, 4, 3), (32, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2),
                                    (128, 8, 2), (128, 4, 1), (256, 4, 1), (256, 8, 1))))
PDL_BUCKETS = (1, 8, 32, 64, 256)
FP8_ROWS = (160, 4096, 32768)  # prefill tokens: one 10.9 s clip, an admission of ~25 clips, of ~200


def compare(got: torch.Tensor, expected: torch.Tensor) -> dict:
    got, expected = got.float(), expected.float()
    return {"identical": float((got == expected).float().mean()), "max_abs": float((got - expected).abs().max()),
            "max_ref": float(expected.abs().max())}


def kernel_cases(cfg, device) -> dict:
    torch.manual_seed(0)
    bf = torch.bfloat16
    D, H, KVH, hd, I, N = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, \
        cfg.intermediate_size, 64
    eps = cfg.rms_norm_eps
    out = {}
    x, residual = torch.randn(N, D, device=device, dtype=bf), torch.randn(N, D, device=device, dtype=bf)
    w = torch.randn(D, device=device, dtype=bf)
    norm = RMSNorm(D, eps).to(device, bf)
    norm.weight.data = w
    out["rms_norm"] = compare(kernels.rms_norm(x, w, eps), norm(x))
    r = residual.clone()
    y = kernels.rms_norm(x, w, eps, r)
    out["add_rms_norm"] = compare(y, norm(residual + x)) | {"residual_identical": bool(torch.equal(r, residual + x))}
    gu = torch.randn(N, 2 * I, device=device, dtype=bf)
    out["silu_mul"] = compare(kernels.silu_mul(gu), F.silu(gu[:, :I]) * gu[:, I:])

    L, S = 336, 8
    qkv = torch.randn(N, (H + 2 * KVH) * hd, device=device, dtype=bf)
    qw, kw = torch.randn(hd, device=device, dtype=bf), torch.randn(hd, device=device, dtype=bf)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    freqs = torch.arange(L, device=device)[:, None].float() * inv
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(bf), emb.sin().to(bf)
    pos = torch.randint(0, L - 1, (N,), device=device)
    slots = torch.randint(0, S, (N,), device=device)
    wpos = torch.randperm(L - 1, device=device)[:N]
    kc = torch.zeros(S, KVH, L, hd, device=device, dtype=bf)
    vc = torch.zeros_like(kc)
    q = kernels.qk_norm_rope_store(qkv, qw, kw, cos, sin, pos, slots, wpos, kc, vc, H, KVH, eps)
    rq, rk, rv = qkv.split([H * hd, KVH * hd, KVH * hd], -1)
    qn, kn = RMSNorm(hd, eps).to(device, bf), RMSNorm(hd, eps).to(device, bf)
    qn.weight.data, kn.weight.data = qw, kw
    c, s = cos[pos][:, None], sin[pos][:, None]
    rq, rk = qn(rq.view(N, H, hd)), kn(rk.view(N, KVH, hd))
    out["q_norm_rope"] = compare(q, rq * c + rotate_half(rq) * s)
    out["k_norm_rope_store"] = compare(kc[slots, :, wpos], rk * c + rotate_half(rk) * s)
    out["v_store"] = compare(vc[slots, :, wpos], rv.view(N, KVH, hd))

    kc, vc = torch.randn_like(kc), torch.randn_like(kc)
    positions = torch.tensor([0, 17, 200, -1, 334, 63, 64, 129], device=device)
    qd = torch.randn(S, H, hd, device=device, dtype=bf)
    got = kernels.decode_attention(qd, kc, vc, positions)
    keys = torch.arange(L, device=device)
    mask = (keys[None, :] <= positions.clamp(min=0)[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(qd[:, :, None], kc.repeat_interleave(H // KVH, 1),
                                         vc.repeat_interleave(H // KVH, 1), attn_mask=mask)
    out["decode_attention"] = compare(got, ref[:, :, 0].reshape(S, -1))

    slots_p, starts, lengths = torch.tensor([2, 5], device=device), torch.tensor([0, 150], device=device), \
        torch.tensor([170, 60], device=device)
    T = 170
    qp = torch.randn(2 * T, H, hd, device=device, dtype=bf)
    got = kernels.prefill_attention(qp, kc, vc, slots_p, starts, lengths).view(2, T, -1)
    rows_got, rows_ref = [], []
    for b in range(2):
        n = int(starts[b]) + int(lengths[b])
        keys = torch.arange(n, device=device)
        pos = int(starts[b]) + torch.arange(int(lengths[b]), device=device)
        mask = (keys[None, :] <= pos[:, None])[None, None]
        qb = qp.view(2, T, H, hd)[b, : int(lengths[b])].transpose(0, 1)[None]  # [1, H, t, hd]
        ref = F.scaled_dot_product_attention(qb, kc[slots_p[b], :, :n].repeat_interleave(H // KVH, 0)[None],
                                             vc[slots_p[b], :, :n].repeat_interleave(H // KVH, 0)[None], attn_mask=mask)
        rows_ref.append(ref[0].transpose(0, 1).reshape(int(lengths[b]), -1))
        rows_got.append(got[b, : int(lengths[b])])
    out["prefill_attention"] = compare(torch.cat(rows_got), torch.cat(rows_ref))

    # the decode step's ends: its start against the PyTorch ops and kernels it replaces, the lm_head's
    # argmax against torch.argmax of the same logits (equal maxima planted in row 0, in three column blocks)
    V = cfg.vocab_size
    embed = torch.randn(V, D, device=device, dtype=bf)
    tokens = torch.randint(0, V, (N,), device=device)
    positions = torch.randint(-1, 300, (N,), device=device)
    h, res, rope_pos, slots_b, write_pos = kernels.decode_begin(tokens, positions, embed, w, eps, 335)
    x_ref = F.embedding(tokens, embed)
    out["decode_begin"] = compare(h, kernels.rms_norm(x_ref.clone(), w, eps)) | {
        "residual_identical": bool(torch.equal(res, x_ref)),
        "positions_identical": bool(torch.equal(rope_pos, positions.clamp(min=0))
                                    and torch.equal(write_pos, torch.where(positions >= 0, positions, 335))
                                    and torch.equal(slots_b, torch.arange(N, device=device)))}
    head = (torch.randn(V, D, device=device) / D ** 0.5).to(bf)
    hx = torch.randn(32, D, device=device, dtype=bf)
    head[[7, 70_000, V - 1]] = 1.0
    hx[0] = 1.0
    logits, maxima = gemv.linear_argmax(hx, head)
    state = [torch.zeros(32, dtype=torch.long, device=device), torch.arange(32, device=device),
             torch.zeros(32, dtype=torch.long, device=device), torch.full((32,), 1 << 30, device=device)]
    res_out = torch.zeros(2, 32, dtype=torch.long, device=device)
    kernels.advance_rows(maxima, *state, torch.tensor([-1], device=device), res_out)
    expected = logits.argmax(dim=-1)
    out["lm_head_argmax"] = {"logits_identical_to_linear": bool(torch.equal(logits, gemv.linear(hx, head))),
                             "tokens_identical": float((res_out[0] == expected).float().mean()),
                             "row0_tie_token": int(res_out[0, 0]), "row0_torch": int(expected[0])}
    return out


def conv1_case(encoder, device, chunks: int = 24) -> dict:
    """The encoder's first convolution with its bias and GELU (conv_kernels.conv1_gelu) against PyTorch's, on mel-like
    chunks of real size."""
    torch.manual_seed(2)
    x = torch.randn(chunks, encoder.cfg.num_mel_bins, encoder.cfg.chunk_frames, device=device,
                    dtype=encoder.conv2d1.weight.dtype)
    return compare(conv1_gelu(x, encoder.conv2d1), F.gelu(encoder.conv2d1(x.unsqueeze(1))))


def step_ms(runner: ModelRunner, B: int, context: int, runs: int = 50) -> float:
    """Median GPU time of bucket B's graphed decode step, its rows live at `context` (reset before each replay)."""
    runner.budgets[:B] = 1 << 30
    ms = replay_ms(runner.graphs[B], lambda: runner.positions[:B].fill_(context), runs)
    runner.positions.fill_(-1)
    return ms


def summed(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Split-K partial sums [S, M, N] added in split order and rounded, as the kernels that take them do."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.to(dtype)


def gemv_cases(cfg, device) -> dict:
    """Each decode-step product at its real shape: GEMV against cuBLAS (F.linear) in bf16 at 1, 16 and 32 rows, the
    same row's bits at every row count (row independence across buckets), and both times at 1 and 16 rows."""
    torch.manual_seed(2)
    bf = torch.bfloat16
    D, I, q_out = cfg.hidden_size, cfg.intermediate_size, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    shapes = {"qkv": (q_out, D), "o_proj": (D, cfg.num_attention_heads * cfg.head_dim), "gate_up_silu": (2 * I, D),
              "down": (D, I), "lm_head": (cfg.vocab_size, D)}
    out = {}
    for name, (N, K) in shapes.items():
        w = (torch.randn(N, K, device=device) / K ** 0.5).to(bf)
        x = torch.randn(32, K, device=device, dtype=bf)
        if name == "gate_up_silu":
            run = lambda a: gemv.gate_up_silu(a, w)  # noqa: E731
            ref = lambda a: F.silu(F.linear(a, w[: N // 2])) * F.linear(a, w[N // 2 :])  # noqa: E731
        elif name == "lm_head":
            run, ref = (lambda a: gemv.linear(a, w)), (lambda a: F.linear(a, w))
        else:
            run, ref = (lambda a: summed(gemv.partial_products(a, w), bf)), (lambda a: F.linear(a, w))
        got = {M: run(x[:M]) for M in (1, 16, 32)}
        row_independent = all(torch.equal(got[M][:1], got[1]) and torch.equal(got[32][:M], got[M]) for M in (1, 16))
        kind = "gate_up_silu" if name == "gate_up_silu" else "linear" if name == "lm_head" else "products"
        config = gemv.config_for(kind, N // 2 if kind == "gate_up_silu" else N, K, x)
        out[name] = compare(got[32], ref(x)) | {
            "row_independent_1_16_32": row_independent, "config": str(config),
            "ms_gemv_1_16": [per_call_ms([lambda: run(x[:M])] * 10) for M in (1, 16)],
            "ms_cublas_1_16": [per_call_ms([lambda: ref(x[:M])] * 10) for M in (1, 16)]}
    return out


def decode_tiles(cfg, device, batches=(1, 32, 256), context: int = 200) -> dict:
    """The decode attention's tiles (kernels.DECODE_TILE first), each in a CUDA graph of 10 calls: us a call at each
    batch, every row at `context`, and whether a tile's output equals the default's bit for bit. The 10 calls read one
    cache, which stays in L2 where it is small (1.3 MB at one row): the step's A/B is the one that decides."""
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for B in batches:
        k = torch.randn(B, kv_heads, OFFLINE_MAX_LEN, hd, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        q = torch.randn(B, heads, hd, device=device, dtype=torch.bfloat16, generator=gen)
        positions = torch.full((B,), context, dtype=torch.long, device=device)
        run = lambda tile: kernels.decode_attention(q, k, v, positions, tile)  # noqa: E731
        default = run(DECODE_TILES[0])
        out[B] = {}
        for tile in DECODE_TILES:
            try:
                got = run(tile)
            except Exception as e:  # a tile the GPU cannot hold (shared memory): noted, the others still run
                out[B]["x".join(map(str, tile))] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                continue
            out[B]["x".join(map(str, tile))] = {
                "us": round(per_call_ms([lambda: run(tile)] * 10) * 1e3, 2),
                "equal_to_default": torch.equal(got, default),
                "max_abs_vs_default": float((got.float() - default.float()).abs().max())}
    return out


def relative_rms(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.float(), expected.float()
    return float((got - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())


def kv_int8_cases(cfg, device, rows=(1, 32, 128, 256, 512), context: int = 200) -> dict:
    """The int8 cache's kernels at real shapes: the writer bit for bit against kv_int8.quantize of the bf16 writer's
    vectors; the readers against the bf16 kernels over the dequantized cache (the kernels' own error) and over the
    original (what quantizing costs); then, per row count, the decode attention's us a call over one cache a layer in
    one graph (each call streams its layer's cache from memory, as a step's do), bf16 against int8 tiles."""
    bf = torch.bfloat16
    H, KVH, hd, layers, eps = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers,
                               cfg.rms_norm_eps)
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    N, S, L = 64, 8, OFFLINE_MAX_LEN
    qkv = torch.randn(N, (H + 2 * KVH) * hd, device=device, dtype=bf, generator=gen)
    qw, kw = torch.randn(hd, device=device, dtype=bf, generator=gen), torch.randn(hd, device=device, dtype=bf,
                                                                                  generator=gen)
    cos, sin = (torch.randn(L, hd, device=device, dtype=bf, generator=gen) for _ in range(2))
    pos = torch.randint(0, L - 1, (N,), device=device, generator=gen)
    slots = torch.randint(0, S, (N,), device=device, generator=gen)
    wpos = torch.randperm(L - 1, device=device)[:N]
    kc, vc = torch.zeros(S, KVH, L, hd, device=device, dtype=bf), torch.zeros(S, KVH, L, hd, device=device, dtype=bf)
    q = kernels.qk_norm_rope_store(qkv, qw, kw, cos, sin, pos, slots, wpos, kc, vc, H, KVH, eps)
    words = [torch.zeros(S, KVH, L, hd // 4, device=device, dtype=torch.int32) for _ in range(2)]
    scales = tuple(torch.zeros(S, KVH, L, device=device) for _ in range(2))
    q8 = kernels.qk_norm_rope_store(qkv, qw, kw, cos, sin, pos, slots, wpos, *words, H, KVH, eps, scales)
    for name, cache, w, s in (("k", kc, words[0], scales[0]), ("v", vc, words[1], scales[1])):
        ew, es = kv_int8.quantize(cache)
        out[f"{name}_store_int8"] = {"words_identical": float((w == ew).float().mean()),
                                     "scales_identical": float((s == es).float().mean())}
    out["q_int8_writer_identical"] = bool(torch.equal(q, q8))

    k, v = (torch.randn(S, KVH, L, hd, device=device, dtype=bf, generator=gen) for _ in range(2))
    (kw8, ks), (vw8, vs) = kv_int8.quantize(k), kv_int8.quantize(v)
    kd, vd = kv_int8.dequantize(kw8, ks, bf), kv_int8.dequantize(vw8, vs, bf)
    positions = torch.tensor([0, 17, 200, -1, 334, 63, 64, 129], device=device)
    qd = torch.randn(S, H, hd, device=device, dtype=bf, generator=gen)
    got = kv_int8.decode_attention(qd, kw8, vw8, (ks, vs), positions)
    out["decode_attention_int8"] = compare(got, kernels.decode_attention(qd, kd, vd, positions)) | {
        "relative_rms_vs_bf16_cache": relative_rms(got, kernels.decode_attention(qd, k, v, positions))}
    slots_p, starts, lengths = (torch.tensor([2, 5], device=device), torch.tensor([0, 150], device=device),
                                torch.tensor([170, 60], device=device))
    qp = torch.randn(2 * 170, H, hd, device=device, dtype=bf, generator=gen)
    got = kv_int8.prefill_attention(qp, kw8, vw8, (ks, vs), slots_p, starts, lengths).view(2, 170, -1)
    ref = kernels.prefill_attention(qp, kd, vd, slots_p, starts, lengths).view(2, 170, -1)
    out["prefill_attention_int8"] = compare(torch.cat([got[0], got[1, :60]]), torch.cat([ref[0], ref[1, :60]]))
    out["prefill_us"] = prefill_int8_us(cfg, device, gen)

    for B in rows:
        q = torch.randn(B, H, hd, device=device, dtype=bf, generator=gen)
        at = torch.full((B,), context, dtype=torch.long, device=device)
        caches = []
        for _ in range(layers):
            k = torch.randn(B, KVH, L, hd, device=device, dtype=bf, generator=gen)
            v = torch.randn(B, KVH, L, hd, device=device, dtype=bf, generator=gen)
            caches.append((k, v, *kv_int8.quantize(k), *kv_int8.quantize(v)))
        us = {"bf16 " + "x".join(map(str, kernels.DECODE_TILE)): per_call_ms(
            [lambda c=c: kernels.decode_attention(q, c[0], c[1], at) for c in caches])}
        for tile in KV_INT8_TILES:
            us["int8 " + "x".join(map(str, tile))] = per_call_ms(
                [lambda c=c, t=tile: kv_int8.decode_attention(q, c[2], c[4], (c[3], c[5]), at, t) for c in caches])
        out[f"us_a_call_{B}_rows"] = {name: round(ms * 1e3, 2) for name, ms in us.items()}
        del caches
        torch.cuda.empty_cache()
    return out


def prefill_int8_us(cfg, device, gen, sequences: int = 32, tokens: int = 160) -> dict:
    """An offline admission's prefill (`sequences` new sequences of `tokens` tokens): the K/V writer and the prefill
    attention, bf16 against int8 (the attention at KV_INT8_PREFILL_TILES), us a call over one cache a layer."""
    bf = torch.bfloat16
    H, KVH, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    N, L, layers = sequences * tokens, OFFLINE_MAX_LEN, 8
    qkv = torch.randn(N, (H + 2 * KVH) * hd, device=device, dtype=bf, generator=gen)
    qw, kw = torch.ones(hd, device=device, dtype=bf), torch.ones(hd, device=device, dtype=bf)
    cos, sin = torch.ones(L, hd, device=device, dtype=bf), torch.zeros(L, hd, device=device, dtype=bf)
    slots = torch.arange(sequences, device=device).repeat_interleave(tokens)
    pos = torch.arange(tokens, device=device).repeat(sequences)
    caches = [(torch.zeros(sequences, KVH, L, hd, device=device, dtype=bf),
               torch.zeros(sequences, KVH, L, hd, device=device, dtype=bf),
               *(torch.zeros(sequences, KVH, L, hd // 4, device=device, dtype=torch.int32) for _ in range(2)),
               *(torch.zeros(sequences, KVH, L, device=device) for _ in range(2))) for _ in range(layers)]
    out = {"writer bf16": per_call_ms([lambda c=c: kernels.qk_norm_rope_store(
        qkv, qw, kw, cos, sin, pos, slots, pos, c[0], c[1], H, KVH, eps) for c in caches]),
           "writer int8": per_call_ms([lambda c=c: kernels.qk_norm_rope_store(
               qkv, qw, kw, cos, sin, pos, slots, pos, c[2], c[3], H, KVH, eps, (c[4], c[5])) for c in caches])}
    q = torch.randn(N, H, hd, device=device, dtype=bf, generator=gen)
    seq = torch.arange(sequences, device=device)
    starts, lengths = torch.zeros_like(seq), torch.full_like(seq, tokens)
    out["attention bf16"] = per_call_ms([lambda c=c: kernels.prefill_attention(q, c[0], c[1], seq, starts, lengths)
                                         for c in caches])
    for tile in KV_INT8_PREFILL_TILES:
        out["attention int8 " + "x".join(map(str, tile))] = per_call_ms([lambda c=c, t=tile: kv_int8.prefill_attention(
            q, c[2], c[3], (c[4], c[5]), seq, starts, lengths, t) for c in caches])
    return {name: round(ms * 1e3, 2) for name, ms in out.items()}


def fp8_products(layer) -> dict:
    """A decoder layer's three FP8 products as fp8.linear takes them (fp8.attach's buffers, without changing the
    model): name -> an object with weight, weight_fp8 and weight_scale."""
    out = {}
    for name in fp8.PRODUCTS:
        weight = layer.get_submodule(name).weight
        q, scale = fp8.quantize_weight(weight)
        out[name.split(".")[-1]] = SimpleNamespace(weight=weight, bias=None, weight_fp8=q, weight_scale=scale)
    return out


def same_rows(got: tuple[torch.Tensor, torch.Tensor], expected: fp8.Rows) -> dict:
    """A quantizing kernel's (e4m3 values, scales) against fp8.quantize_rows': the fraction identical of each, the
    values bit for bit."""
    values = got[0].view(torch.uint8) == expected.values.view(torch.uint8)
    return {"values_identical": float(values.float().mean()),
            "scales_identical": float((got[1] == expected.scales).float().mean())}


def fp8_agreement(layer, products: dict, rows: int, device, splits: int = 4) -> dict:
    """FP8 prefill's kernels on `rows` tokens of one decoder layer: each quantizing kernel (the input RMSNorm with a
    residual, the post-attention one summing split partial products, the SiLU*mul) against fp8.quantize_rows of the
    bf16 kernel's output, as the fraction of identical values and scales; each product's relative RMS error against
    the bf16 product of the same (unquantized) rows."""
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = layer.input_layernorm.weight.dtype
    D, I = layer.input_layernorm.weight.numel(), layer.mlp.down_proj.in_features

    def rand(*shape, scale=1.0, dt=dtype):
        return scale * torch.randn(*shape, device=device, dtype=dt, generator=gen)

    norm, post = layer.input_layernorm, layer.post_attention_layernorm
    x, residual = rand(rows, D, scale=3.0), rand(rows, D)

    def normed(x, norm, fp8_on: bool):
        return kernels.rms_norm(x, norm.weight, norm.eps, residual.clone(), fp8=fp8_on)

    out = {"input_norm": same_rows(normed(x, norm, True), fp8.quantize_rows(normed(x, norm, False)))}
    parts = rand(splits, rows, D, dt=torch.float32)
    out["post_norm_partials"] = same_rows(normed(parts, post, True), fp8.quantize_rows(normed(parts, post, False)))
    gate_up = rand(rows, 2 * I, scale=4.0)
    out["silu_mul"] = same_rows(kernels.silu_mul(gate_up, fp8=True), fp8.quantize_rows(kernels.silu_mul(gate_up)))
    for name, product in products.items():
        a = rand(rows, product.weight.shape[1])
        out[f"{name}_relative_rms"] = relative_rms(fp8.linear(fp8.quantize_rows(a), product),
                                                   F.linear(a, product.weight))
    return out


def fp8_encoder_agreement(layer, rows: int, device) -> dict:
    """The FP8 encoder's kernels on `rows` tokens of one encoder layer: the LayerNorm and GELU kernels against
    PyTorch's (fraction of identical values), their quantizing form against fp8.quantize_rows of the plain kernel's
    output (as fp8_agreement), and fc1's and fc2's FP8 products (bias added) against bf16's (relative RMS error)."""
    gen = torch.Generator(device=device).manual_seed(1)
    norm = layer.final_layer_norm
    x = 3 * torch.randn(rows, norm.weight.numel(), device=device, dtype=norm.weight.dtype, generator=gen)
    h = torch.randn(rows, layer.fc1.out_features, device=device, dtype=x.dtype, generator=gen)

    def identical(got, expected) -> float:
        return float((got == expected).float().mean())

    normed = kernels.layer_norm(x, norm.weight, norm.bias, norm.eps)
    out = {"layer_norm_vs_pytorch": identical(normed, F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)),
           "layer_norm_fp8": same_rows(kernels.layer_norm(x, norm.weight, norm.bias, norm.eps, fp8=True),
                                       fp8.quantize_rows(normed)),
           "gelu_vs_pytorch": identical(kernels.gelu(h), F.gelu(h)),
           "gelu_fp8": same_rows(kernels.gelu(h, fp8=True), fp8.quantize_rows(kernels.gelu(h)))}
    for name, a in (("fc1", x), ("fc2", h)):
        product = getattr(layer, name)
        q, scale = fp8.quantize_weight(product.weight)
        fp8_product = SimpleNamespace(weight=product.weight, bias=product.bias, weight_fp8=q, weight_scale=scale)
        out[f"{name}_relative_rms"] = relative_rms(fp8.linear(fp8.quantize_rows(a), fp8_product),
                                                   F.linear(a, product.weight, product.bias))
    return out


def fp8_times_us(layer, products: dict, rows: int, device) -> dict:
    """us a call at `rows` tokens: each quantizing kernel and product against the bf16 one it replaces, and a layer's
    prefill chain without attention (norm, qkv; norm, gate_up, SiLU*mul, down) each way."""
    dtype = layer.input_layernorm.weight.dtype
    D, I = layer.input_layernorm.weight.numel(), layer.mlp.down_proj.in_features
    norm, post = layer.input_layernorm, layer.post_attention_layernorm
    x, residual, gate_up = (torch.randn(rows, n, device=device, dtype=dtype) for n in (D, D, 2 * I))
    rows_d, rows_i = fp8.quantize_rows(x), fp8.quantize_rows(torch.randn(rows, I, device=device, dtype=dtype))

    def chain(fp8_on: bool):
        h = kernels.rms_norm(x, norm.weight, norm.eps, residual, fp8=fp8_on)
        mul = (lambda v, p: fp8.linear(fp8.Rows(*v), p)) if fp8_on else (lambda v, p: F.linear(v, p.weight))
        mul(h, products["qkv_proj"])
        h = kernels.rms_norm(x, post.weight, post.eps, residual, fp8=fp8_on)
        mul(kernels.silu_mul(mul(h, products["gate_up_proj"]), fp8=fp8_on), products["down_proj"])

    calls = {"rms_norm bf16": lambda: kernels.rms_norm(x, norm.weight, norm.eps, residual),
             "rms_norm fp8": lambda: kernels.rms_norm(x, norm.weight, norm.eps, residual, fp8=True),
             "silu_mul bf16": lambda: kernels.silu_mul(gate_up),
             "silu_mul fp8": lambda: kernels.silu_mul(gate_up, fp8=True),
             "chain bf16": lambda: chain(False), "chain fp8": lambda: chain(True)}
    for name, product in products.items():
        a = rows_i if name == "down_proj" else rows_d
        dense = torch.randn(rows, a.values.shape[1], device=device, dtype=dtype)
        calls[f"{name} bf16"] = lambda p=product, v=dense: F.linear(v, p.weight)
        calls[f"{name} fp8"] = lambda p=product, v=a: fp8.linear(v, p)
    return {name: round(per_call_ms([call] * 4) * 1e3, 2) for name, call in calls.items()}


def fp8_cases(model, device, rows=FP8_ROWS) -> dict:
    """The `fp8` section: agreement at the largest row count (it covers the others' code paths), times at each."""
    try:
        fp8.check_supported(device, model.dtype)
    except RuntimeError as e:
        return {"skipped": str(e)}
    layer = model.decoder.layers[0]
    with torch.no_grad():
        products = fp8_products(layer)  # quantized once for every row count
        return {"agreement": fp8_agreement(layer, products, max(rows), device),
                "encoder_agreement": fp8_encoder_agreement(model.encoder.layers[0], max(rows), device),
                **{f"us_a_call_{n}_rows": fp8_times_us(layer, products, n, device) for n in rows}}


def fp8_weight_products(cfg, device, rows=(1, 16, 32)) -> dict:
    """Each _gemv_kernel product's weight rounded to FP8: its FP8 GEMV against the bf16 GEMV over the rounded image
    with the same config (bit for bit), and us a call of both (FP8's own tuned config too), each call streaming its
    weight from memory (copies past L2, as gemv's tuner times)."""
    torch.manual_seed(3)
    bf = torch.bfloat16
    D, I = cfg.hidden_size, cfg.intermediate_size
    q_out = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    shapes = {"qkv": ("products", q_out, D), "o_proj": ("products", D, cfg.num_attention_heads * cfg.head_dim),
              "down": ("products", D, I), "lm_head": ("linear", cfg.vocab_size, D)}
    run = {"products": gemv.partial_products, "linear": gemv.linear}
    out = {}
    for name, (kind, N, K) in shapes.items():
        copies = max(1, min(16, -(-gemv.TUNE_WEIGHT_BYTES // (N * K))))  # FP8 bytes past L2 (bf16's twice that)
        weights = [fp8_lm_head.round_weight((torch.randn(N, K, device=device) / K ** 0.5).to(bf))
                   for _ in range(copies)]
        x = torch.randn(max(rows), K, device=device, dtype=bf)
        bf16_config = gemv.config_for(kind, N, K, x)
        fp8_config = gemv.config_for(kind, N, K, x, fp8_lm_head.E4M3)
        w = weights[0]
        same = all(torch.equal(run[kind](x[:M], w.values, bf16_config, scale=w.scales),
                               run[kind](x[:M], w.image, bf16_config)) for M in rows)
        times = {}
        for label, config, fp8_bytes in (("bf16", bf16_config, False), ("fp8_same_config", bf16_config, True),
                                         ("fp8", fp8_config, True)):
            def call(r, M, config=config, fp8_bytes=fp8_bytes):
                if fp8_bytes:
                    return run[kind](x[:M], r.values, config, scale=r.scales)
                return run[kind](x[:M], r.image, config)
            times[label] = [round(1e3 * per_call_ms([functools.partial(call, r, M) for r in weights]), 2)
                            for M in rows]
        out[name] = {"fp8_equals_bf16_over_image": same, "bf16_config": str(bf16_config),
                     "fp8_config": str(fp8_config), "us_at_rows": list(rows)} | times
    return out


def fp8_lm_head_steps(model, device, buckets=(1, 8, 16, 32, 64, 256), context: int = 200, rounds: int = 3) -> dict:
    """The graphed decode step on the model's own lm_head and on it rounded to FP8 (two runners, each with its
    cache, filled alike): ms a replay at each bucket over alternating rounds, and the share of the rows (all live at
    `context`, the same tokens) whose greedy token the rounding changed."""
    S = max(buckets)
    runners = {}
    for label, rounded in (("bf16", False), ("fp8_lm_head", True)):
        runners[label] = ModelRunner(model, num_slots=S, max_len=OFFLINE_MAX_LEN, fused_kernels=True,
                                     buckets=tuple(b for b in buckets if b < S), fp8_lm_head=rounded)
    tokens = torch.randint(0, model.cfg.text.vocab_size, (S,), device=device,
                           generator=torch.Generator(device=device).manual_seed(6))
    for runner in runners.values():
        gen = torch.Generator(device=device).manual_seed(5)
        for layer in (*runner.cache.k, *runner.cache.v):
            layer.normal_(generator=gen)
    out = {"step_ms": {label: {B: [] for B in buckets} for label in runners}, "token_agreement": {}}
    for _ in range(rounds):
        for label, runner in runners.items():
            for B in buckets:
                out["step_ms"][label][B].append(round(step_ms(runner, B, context), 4))
    for B in buckets:
        made = {}
        for label, runner in runners.items():
            runner.tokens.copy_(tokens)
            runner.positions[:B] = context
            runner.budgets[:B] = 1 << 30
            runner.graphs[B].replay()
            made[label] = runner.out[0, :B].clone()
            runner.positions.fill_(-1)
        out["token_agreement"][B] = float((made["bf16"] == made["fp8_lm_head"]).float().mean())
    out["kernels_per_step"] = {label: kernels_per_step(runner, 1, context) for label, runner in runners.items()}
    del runners
    return out


def triton_kernel_names() -> set[str]:
    """The names the profiler gives the launches of kernels.py's, gemv.py's and kv_int8.py's Triton kernels."""
    import triton

    return {name for module in (kernels, gemv, kv_int8) for name, value in vars(module).items()
            if isinstance(value, triton.runtime.jit.JITFunction)}


def launch_kinds(names: list[str], triton_names: set[str], replays: int = 1) -> dict:
    """Launches in GPU order (`replays` steps' worth) by kind, per step: Triton kernels (PDL can start each before the
    previous ends), other kernels (cuBLAS, PyTorch: launched plainly, each starts after the previous kernel ends),
    copies and sets. `chain_breaks`: Triton kernels whose previous launch is not a Triton kernel (no overlap there);
    `other_names`: the non-Triton kernels by name."""
    kinds = ["copy" if n.startswith(("Memcpy", "Memset")) else "triton" if n in triton_names else "other"
             for n in names]
    other: dict[str, float] = {}
    for name, kind in zip(names, kinds):
        if kind == "other":
            other[name[:90]] = other.get(name[:90], 0) + 1 / replays
    breaks = sum(1 for i, k in enumerate(kinds) if k == "triton" and (i == 0 or kinds[i - 1] != "triton"))
    return {k: kinds.count(k) / replays for k in ("triton", "other", "copy")} | {
        "chain_breaks": breaks / replays, "other_names": other}


def kernel_kinds(replay, replays: int = 3) -> dict:
    """launch_kinds of `replays` calls of replay() (a graph's), from the profiler's GPU events in start order."""
    prof = profiled(replay, replays)
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    return launch_kinds([e.name for e in events], triton_kernel_names(), replays)


def pdl_steps(model, device, buckets=PDL_BUCKETS, context: int = 200) -> dict:
    """The decode step with QASR_PDL=0 and =1 on one runner (one cache, one graph pool): ms per graph replay at each
    bucket, the logits of the two bit for bit (the same kernels and configs; a missing wait would show as a race),
    and the kernels of a step by kind at 1 and 64 rows."""
    S = max(buckets)
    runner = ModelRunner(model, num_slots=S, max_len=OFFLINE_MAX_LEN, fused_kernels=True, cuda_graphs=False,
                         buckets=tuple(b for b in buckets if b < S))
    gen = torch.Generator(device=device).manual_seed(5)
    for layer in (*runner.cache.k, *runner.cache.v):
        layer.normal_(generator=gen)
    tokens = torch.randint(0, model.cfg.text.vocab_size, (S,), device=device, generator=gen)
    decoder = model.decoder

    def reset(B: int) -> None:  # every row live at `context`, the same tokens: a replay rewrites the same cache cells
        runner.tokens.copy_(tokens)
        runner.positions[:B] = context
        runner.budgets[:B] = 1 << 30

    def step(B: int):
        runner._step(B)

    def logits(B: int):
        return decoder.decode(runner.tokens[:B], runner.positions[:B], runner.cache, runner.layer_ops)

    graphs: dict[tuple[str, str, int], tuple] = {}  # (step or logits, QASR_PDL, bucket) -> (graph, its output)
    out = {"use_pdl_when_on": None, "step_ms": {}, "logits_identical": {}, "logits_max_abs": {}, "kinds": {}}
    t0 = time.perf_counter()
    pool = None
    with torch.inference_mode():
        for value in ("0", "1"):
            with mock.patch.dict(os.environ, {kernels.PDL_ENV: value}), capture_stream() as stream:
                if value == "1":
                    out["use_pdl_when_on"] = kernels.use_pdl(device)
                for B in reversed(buckets):
                    reset(B)
                    for kind, fn in (("step", step), ("logits", logits)):
                        graph, result = capture_graph(lambda: fn(B), stream, pool, warmups=2)
                        pool = graph.pool() if pool is None else pool
                        graphs[(kind, value, B)] = (graph, result)
        out["capture_s"] = time.perf_counter() - t0
        for B in buckets:
            got = {}
            for value in ("0", "1"):
                graph, result = graphs[("logits", value, B)]
                reset(B)
                graph.replay()
                got[value] = result.float().clone()
            out["logits_identical"][B] = float((got["0"] == got["1"]).float().mean())
            out["logits_max_abs"][B] = float((got["0"] - got["1"]).abs().max())
            for value in ("0", "1"):
                out["step_ms"].setdefault(f"pdl{value}", {})[B] = replay_ms(graphs[("step", value, B)][0],
                                                                          lambda: reset(B))
        for B in (1, 64):
            if B in buckets:  # rows stay live for the few replays profiled (each moves them on by one position)
                reset(B)
                out["kinds"][B] = kernel_kinds(graphs[("step", "1", B)][0].replay)
    runner.positions.fill_(-1)
    del graphs, runner
    torch.cuda.empty_cache()
    return out


def size_and_sections(prog: str, known: tuple[str, ...], argv=None) -> tuple[str, set[str]]:
    """The GPU checks' command line: `[0.6B|1.7B] [--sections a,b]` (default: all of `known`)."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("size", nargs="?", default="0.6B", choices=("0.6B", "1.7B"))
    parser.add_argument("--sections", default=",".join(known), help=f"comma-separated, of {known}")
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    if not sections <= set(known):
        parser.error(f"--sections takes {known}, got {args.sections!r}")
    return args.size, sections


def main(argv=None) -> None:
    size, sections = size_and_sections("python -m qasr.bench.kernel_check", SECTIONS, argv)
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        d = make_test_model(f"{tmp}/m", size=size, dtype="bfloat16")
        engine = Engine.from_pretrained(str(d), device=device, dtype="bfloat16",
                                        options=EngineOptions(num_slots=64, max_len=OFFLINE_MAX_LEN, num_retained=0,
                                                              cuda_graphs=False))
    model = engine.model

    def emit(section: str, value) -> None:
        print(json.dumps({section: value}), flush=True)

    emit("size", size)
    emit("pdl", {"QASR_PDL": os.environ.get(kernels.PDL_ENV, "unset (on)"), "use_pdl": kernels.use_pdl(device),
                 "capability": ".".join(map(str, torch.cuda.get_device_capability(device)))})
    if "pdl" in sections:
        t = time.perf_counter()
        emit("decode_step_pdl", pdl_steps(model, device))
        emit("decode_step_pdl_s", time.perf_counter() - t)
    if "kernels" in sections:
        emit("kernels_bf16_vs_pytorch", kernel_cases(model.cfg.text, device))
        emit("conv1_gelu_bf16_vs_pytorch", conv1_case(model.encoder, device))
    if "gemv" in sections:
        t = time.perf_counter()
        emit("gemv_bf16_vs_cublas", gemv_cases(model.cfg.text, device))
        emit("gemv_cases_s", time.perf_counter() - t)
        emit("gemv_configs", gemv.chosen_configs())
    if "decode_tiles" in sections:
        emit("decode_attention_tiles", decode_tiles(model.cfg.text, device))
    if "kv_int8" in sections:
        t = time.perf_counter()
        emit("kv_int8", kv_int8_cases(model.cfg.text, device))
        emit("kv_int8_s", time.perf_counter() - t)
    if "fp8" in sections:
        t = time.perf_counter()
        emit("fp8_prefill", fp8_cases(model, device))
        emit("fp8_s", time.perf_counter() - t)
    if "fp8_lm_head" in sections:
        t = time.perf_counter()
        emit("fp8_weight_products", fp8_weight_products(model.cfg.text, device))
        emit("fp8_lm_head_steps", fp8_lm_head_steps(model, device))
        emit("fp8_lm_head_s", time.perf_counter() - t)
    if "steps" not in sections:
        return
    for name, fused, rows in (("fused_gemv", True, gemv.max_rows()), ("fused_cublas", True, 0), ("pytorch", False, 0)):
        with mock.patch.dict(os.environ, {gemv.MAX_ROWS_ENV: str(rows)}):  # read when a runner is made
            runner = ModelRunner(model, num_slots=64, max_len=OFFLINE_MAX_LEN, fused_kernels=fused)
        emit(f"decode_step_ms_context_200_{name}", {B: step_ms(runner, B, 200) for B in (1, 8, 16, 32, 64)})
        emit(f"kernels_per_step_{name}", {B: kernels_per_step(runner, B, 200) for B in (1, 64)})
        if name == "fused_gemv":  # encoder graphs against the eager encoder, same windows
            enc = model.encoder
            torch.manual_seed(1)
            windows = torch.randn(3, enc.cfg.window_tokens, enc.cfg.d_model, device=device, dtype=model.dtype)
            lengths = torch.tensor([enc.cfg.window_tokens, 40, 7], device=device)
            eager = enc.encode_windows(windows, lengths)
            graphed = runner.encode_windows(windows, lengths)
            emit("encoder_graph_vs_eager", compare(
                torch.cat([graphed[i, :n] for i, n in enumerate(lengths.tolist())]),
                torch.cat([eager[i, :n] for i, n in enumerate(lengths.tolist())])))
            for W in (2, 16):
                w = torch.randn(W, enc.cfg.window_tokens, enc.cfg.d_model, device=device, dtype=model.dtype)
                n = torch.full((W,), enc.cfg.window_tokens, device=device)
                times = {}
                for label, fn in (("eager", lambda: enc.encode_windows(w, n)), ("graph", lambda: runner.encode_windows(w, n))):
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(20):
                        fn()
                    torch.cuda.synchronize()
                    times[label] = (time.perf_counter() - t) / 20 * 1e3
                emit(f"encoder_ms_{W}_windows", times)
        del runner
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
