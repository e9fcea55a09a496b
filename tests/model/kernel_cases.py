"""Cases for the fused Triton kernels, run by test_kernels.py in a child pytest with TRITON_INTERPRET=1 (Triton's
CPU interpreter must be chosen before the kernels are defined, so they cannot share this process with other tests).

In float32, where the interpreter rounds as a GPU does, each kernel must match the PyTorch reference in modeling.py
to float32 rounding, and the engine on the kernels must produce the same tokens as on plain PyTorch. (The interpreter
truncates float32 -> bfloat16 where a GPU rounds to nearest, so bfloat16 is checked on the GPU, in the benchmarks.)
"""

import contextlib
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from types import SimpleNamespace

from qasr.model import conv_kernels, fp8, fp8_lm_head, gemv, kernels, kv_int8
from qasr.model.modeling import FusedLayerOps, PlainLayerOps, RMSNorm, rotate_half
from qasr.engine import runner as runner_module
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest, Priority

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/model/test_kernels.py"
# test_kernels.py runs these with $QASR_FUSED_CONV1=0 (PyTorch's first convolution in the engines: its kernel is ~17 s a
# chunk here); the kernel's own cases, and test_the_engine_on_the_fused_first_convolution_..., turn it on

TOL = 2e-6


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def norm_module(weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], 1e-6)
    norm.weight.data = weight
    return norm


@pytest.mark.parametrize("width", [64, 96, 1024])
def test_rms_norm(width):
    x, w = torch.randn(5, width), torch.randn(width)
    assert torch.allclose(kernels.rms_norm(x, w, 1e-6), norm_module(w)(x), atol=TOL, rtol=TOL)


def test_add_rms_norm_updates_the_residual_in_place():
    x, residual, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    expected_sum = residual + x
    y = kernels.rms_norm(x, w, 1e-6, residual)
    assert torch.equal(residual, expected_sum)
    assert torch.allclose(y, norm_module(w)(expected_sum), atol=TOL, rtol=TOL)


def test_silu_mul():
    gate_up = torch.randn(3, 2 * 1500)  # more than one column block
    expected = F.silu(gate_up[:, :1500]) * gate_up[:, 1500:]
    assert torch.allclose(kernels.silu_mul(gate_up), expected, atol=TOL, rtol=TOL)


# a real chunk (one: ~17 s a call in the interpreter); odd sizes, few positions, more than one chunk
@pytest.mark.parametrize("chunks, height, width", [(1, 128, 100), (2, 9, 7)])
def test_conv1_gelu_is_the_first_convolution_with_its_bias_and_gelu(chunks, height, width):
    conv = torch.nn.Conv2d(1, 100, 3, 2, padding=1)  # 100 channels: more than one channel block, the last masked
    x = torch.randn(chunks, height, width)
    expected = F.gelu(conv(x.unsqueeze(1)))
    with torch.no_grad():
        y = conv_kernels.conv1_gelu(x, conv)
    assert y.shape == expected.shape and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(y, expected, atol=TOL, rtol=TOL)
    with torch.no_grad():  # another tile: the same sums, the same bits
        assert torch.equal(conv_kernels.conv1_gelu(x, conv, tile=(32, 32, 2)), y)


def test_the_gpu_kernel_checks_conv1_case_compares_the_kernel_with_pytorch(monkeypatch):
    from qasr.bench import kernel_check
    from qasr.model.config import AudioEncoderConfig
    from qasr.model.modeling import AudioEncoder

    encoder = AudioEncoder(AudioEncoderConfig(d_model=32, encoder_layers=0, encoder_attention_heads=2,
                                              downsample_hidden_size=72, output_dim=16))
    with torch.no_grad():
        r = kernel_check.conv1_case(encoder, torch.device("cpu"), chunks=1)
        # (how many elements come out bit-identical depends on the CPU's convolution algorithm: only the error is
        # asserted; a session-17 host, an AMD EPYC, had 17% identical where earlier hosts had over half)
        assert r["max_abs"] <= TOL * max(1.0, r["max_ref"])
        # a kernel that lost its GELU is caught
        monkeypatch.setattr(kernel_check, "conv1_gelu", lambda x, conv: conv(x.unsqueeze(1)))
        wrong = kernel_check.conv1_case(encoder, torch.device("cpu"), chunks=1)
    assert wrong["max_abs"] > 0.01 * wrong["max_ref"]


def test_conv1_gelu_refuses_another_convolution():
    with pytest.raises(ValueError, match="3x3 stride-2"):
        conv_kernels.conv1_gelu(torch.randn(1, 8, 8), torch.nn.Conv2d(1, 4, 3, 1, padding=1))


def rope_tables(length: int, hd: int):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.arange(length)[:, None].float() * inv
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


# a few tokens: a program a head; 40 tokens: a program per group of heads dividing both counts (2 of 4 and 2; 6 and 3
# share none larger than 1)
@pytest.mark.parametrize("H,KVH,N", [(4, 2, 7), (4, 2, 40), (6, 3, 40)])
def test_qk_norm_rope_store_matches_reference_and_writes_only_its_positions(H, KVH, N):
    assert kernels.qk_heads_per_program(H, KVH, N) == (2 if (H, N) == (4, 40) else 1)
    hd, S, L = 16, 6, 48
    qkv = torch.randn(N, (H + 2 * KVH) * hd)
    qw, kw = torch.randn(hd), torch.randn(hd)
    cos, sin = rope_tables(L, hd)
    rope_pos = torch.randint(0, L, (N,))
    slots = torch.randint(0, S, (N,))
    write_pos = torch.randperm(L)[:N]
    k_cache, v_cache = torch.zeros(S, KVH, L, hd), torch.zeros(S, KVH, L, hd)
    q = kernels.qk_norm_rope_store(qkv, qw, kw, cos, sin, rope_pos, slots, write_pos, k_cache, v_cache, H, KVH, 1e-6)

    rq, rk, rv = qkv.split([H * hd, KVH * hd, KVH * hd], -1)
    c, s = cos[rope_pos][:, None], sin[rope_pos][:, None]
    rq = norm_module(qw)(rq.view(N, H, hd))
    rk = norm_module(kw)(rk.view(N, KVH, hd))
    assert torch.allclose(q, rq * c + rotate_half(rq) * s, atol=TOL, rtol=TOL)
    assert torch.allclose(k_cache[slots, :, write_pos], rk * c + rotate_half(rk) * s, atol=TOL, rtol=TOL)
    assert torch.equal(v_cache[slots, :, write_pos], rv.view(N, KVH, hd))
    written = torch.zeros(S, L, dtype=torch.bool)
    written[slots, write_pos] = True
    assert not k_cache.transpose(1, 2)[~written].any() and not v_cache.transpose(1, 2)[~written].any()


@pytest.mark.parametrize("H,KVH,N", [(4, 2, 7), (4, 2, 40)])
def test_qk_norm_rope_store_into_an_int8_cache_stores_what_kv_int8_quantize_stores(H, KVH, N):
    hd, S, L = 16, 6, 48
    qkv = torch.randn(N, (H + 2 * KVH) * hd)
    qw, kw = torch.randn(hd), torch.randn(hd)
    cos, sin = rope_tables(L, hd)
    rope_pos, slots, write_pos = torch.randint(0, L, (N,)), torch.randint(0, S, (N,)), torch.randperm(L)[:N]
    qkv[0, (H + KVH) * hd:(H + KVH + 1) * hd] = 0  # token 0's first value: all zeros, scale 0
    k_cache, v_cache = torch.zeros(S, KVH, L, hd), torch.zeros(S, KVH, L, hd)
    args = (qkv, qw, kw, cos, sin, rope_pos, slots, write_pos)
    q = kernels.qk_norm_rope_store(*args, k_cache, v_cache, H, KVH, 1e-6)
    words = [torch.zeros(S, KVH, L, hd // 4, dtype=torch.int32) for _ in range(2)]
    scales = (torch.zeros(S, KVH, L), torch.zeros(S, KVH, L))
    assert torch.equal(kernels.qk_norm_rope_store(*args, *words, H, KVH, 1e-6, scales), q)
    for cache, stored, scale in ((k_cache, words[0], scales[0]), (v_cache, words[1], scales[1])):
        expected_words, expected_scales = kv_int8.quantize(cache)
        assert torch.equal(stored, expected_words) and torch.equal(scale, expected_scales)  # bit for bit
        assert torch.allclose(kv_int8.dequantize(stored, scale, cache.dtype), cache,
                              atol=0.5 * float(cache.abs().max()) / kv_int8.QMAX + 1e-6)
    assert scales[1][slots[0], 0, write_pos[0]] == 0 and not words[1][slots[0], 0, write_pos[0]].any()


if kernels.triton is not None:
    import triton.language as tl

    @kernels.triton.jit
    def _quarters_probe(WORDS, OUT, N: tl.constexpr, QD: tl.constexpr):
        # kv_int8._quarters on [N, QD] words, its four quarters stored side by side: [N, 4 * QD] in OUT's dtype
        at = tl.arange(0, N)[:, None] * QD + tl.arange(0, QD)[None, :]
        b0, b1, b2, b3 = kv_int8._quarters(tl.load(WORDS + at), OUT.dtype.element_ty)
        out = tl.arange(0, N)[:, None] * 4 * QD + tl.arange(0, QD)[None, :]
        tl.store(OUT + out, b0)
        tl.store(OUT + out + QD, b1)
        tl.store(OUT + out + 2 * QD, b2)
        tl.store(OUT + out + 3 * QD, b3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_int8_readers_take_every_byte_value_apart_exactly(dtype):
    """_quarters builds each byte's value from float bits (no int-to-float conversion): every int8 value, at every
    byte of a word, must come out as exactly that integer (bfloat16: the upper half of its float32)."""
    values = torch.arange(-128, 128, dtype=torch.int8)
    q = torch.stack([values.roll(17 * i) for i in range(4)], -1).reshape(64, 16)  # every value at every byte
    words = q.unflatten(-1, (4, 4)).transpose(-1, -2).contiguous().flatten(-2).view(torch.int32)  # quantize's packing
    assert torch.equal(kv_int8.unpack(words), q)
    out = torch.empty(64, 16, dtype=dtype)
    _quarters_probe[(1,)](words, out, N=64, QD=4)
    assert torch.equal(out, q.to(dtype))


def int8_cache(S: int, kv_heads: int, L: int, hd: int):
    """A random int8 cache (words, (key scales, value scales)) and the float32 cache it stands for."""
    k, v = torch.randn(S, kv_heads, L, hd), 0.1 * torch.randn(S, kv_heads, L, hd)
    (kw, ks), (vw, vs) = kv_int8.quantize(k), kv_int8.quantize(v)
    return (kw, vw, (ks, vs)), (kv_int8.dequantize(kw, ks, k.dtype), kv_int8.dequantize(vw, vs, v.dtype))


@pytest.mark.parametrize("heads,kv_heads,tile", [(4, 2, kv_int8.DECODE_TILE), (6, 2, (32, 2, 2))])
def test_int8_decode_attention_is_the_attention_over_the_dequantized_cache(heads, kv_heads, tile):
    hd, S, L = 16, 7, 160
    (kw, vw, scales), (k_cache, v_cache) = int8_cache(S, kv_heads, L, hd)
    positions = torch.tensor([0, 5, -1, 63, 64, 128, 150])  # around the key blocks; -1: a padding row
    q = torch.randn(len(positions), heads, hd)
    out = kv_int8.decode_attention(q, kw, vw, scales, positions, tile)
    assert torch.allclose(out, kernels.decode_attention(q, k_cache, v_cache, positions), atol=TOL, rtol=TOL)
    for b in range(len(positions)):  # keys past a row's position must not matter
        kw[b, :, max(int(positions[b]), 0) + 1:] = 0x7F7F7F7F
        scales[0][b, :, max(int(positions[b]), 0) + 1:] = 1e4
    assert torch.equal(kv_int8.decode_attention(q, kw, vw, scales, positions, tile), out)


def test_int8_prefill_attention_is_the_attention_over_the_dequantized_cache():
    heads, kv_heads, hd, S, L = 4, 2, 16, 6, 96
    (kw, vw, scales), (k_cache, v_cache) = int8_cache(S, kv_heads, L, hd)
    slots, starts, lengths = torch.tensor([3, 0, 5]), torch.tensor([0, 40, 7]), torch.tensor([20, 13, 5])
    T = 20
    q = torch.randn(len(slots) * T, heads, hd)
    out = kv_int8.prefill_attention(q, kw, vw, scales, slots, starts, lengths)
    expected = kernels.prefill_attention(q, k_cache, v_cache, slots, starts, lengths)
    valid = (torch.arange(T)[None] < lengths[:, None]).reshape(-1)
    assert torch.allclose(out[valid], expected[valid], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("heads,kv_heads,tile", [(4, 2, None), (4, 4, None), (6, 2, None), (4, 2, (32, 2, 2)),
                                                  (4, 2, (64, 4, 3))])
def test_decode_attention_reads_each_rows_live_keys(heads, kv_heads, tile):
    hd, S, L = 16, 7, 160
    k_cache, v_cache = torch.randn(S, kv_heads, L, hd), torch.randn(S, kv_heads, L, hd)
    positions = torch.tensor([0, 5, -1, 63, 64, 128, 150])  # around 32-, 64- and 128-key blocks; -1: a padding row
    B = len(positions)
    q = torch.randn(B, heads, hd)
    out = kernels.decode_attention(q, k_cache, v_cache, positions, tile)
    group = heads // kv_heads
    for b in range(B):
        n = max(int(positions[b]), 0) + 1
        k = k_cache[b, :, :n].repeat_interleave(group, 0)
        v = v_cache[b, :, :n].repeat_interleave(group, 0)
        expected = F.scaled_dot_product_attention(q[b][:, None], k, v)[:, 0].reshape(-1)
        assert torch.allclose(out[b], expected, atol=TOL, rtol=TOL), b
    # keys past a row's position must not matter
    for b in range(B):
        k_cache[b, :, max(int(positions[b]), 0) + 1:] = 1e4
    assert torch.equal(kernels.decode_attention(q, k_cache, v_cache, positions, tile), out)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
def test_prefill_attention_is_causal_over_each_slots_cache(heads, kv_heads):
    hd, S, L = 16, 6, 96
    k_cache, v_cache = torch.randn(S, kv_heads, L, hd), torch.randn(S, kv_heads, L, hd)
    slots = torch.tensor([3, 0, 5])
    starts = torch.tensor([0, 40, 7])  # sequence 1 continues after 40 cached positions (a reused prefix)
    lengths = torch.tensor([20, 37, 1])
    B, T = 3, 37  # crosses the 16- or 32-token tiles and a 64-key block
    q = torch.randn(B * T, heads, hd)
    out = kernels.prefill_attention(q, k_cache, v_cache, slots, starts, lengths).view(B, T, heads * hd)
    group = heads // kv_heads
    for b in range(B):
        for t in range(int(lengths[b])):
            n = int(starts[b]) + t + 1
            k = k_cache[slots[b], :, :n].repeat_interleave(group, 0)
            v = v_cache[slots[b], :, :n].repeat_interleave(group, 0)
            expected = F.scaled_dot_product_attention(q[b * T + t][:, None], k, v)[:, 0].reshape(-1)
            assert torch.allclose(out[b, t], expected, atol=TOL, rtol=TOL), (b, t)
    # a sequence's rows do not depend on its batch mates
    alone = kernels.prefill_attention(q[T : 2 * T], k_cache, v_cache, slots[1:2], starts[1:2], lengths[1:2])
    assert torch.equal(alone.view(T, -1)[:37], out[1, :37])
    # another tile (bench.prefill_cost compares them) computes the same attention, to rounding
    other = kernels.prefill_attention(q, k_cache, v_cache, slots, starts, lengths, tile_rows=16, num_warps=2)
    for b in range(B):
        n = int(lengths[b])
        assert torch.allclose(other.view(B, T, -1)[b, :n], out[b, :n], atol=TOL, rtol=TOL), b


# -- the small-batch matrix products (model/gemv.py) -------------------------------------------------------------

GEMV_CONFIGS = [gemv.GemvConfig(32, 64), gemv.GemvConfig(32, 64, split=3), gemv.GemvConfig(16, 16, split=4)]


@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=str)
@pytest.mark.parametrize("rows", [1, 5, 20])  # 20: two 16-row tiles
def test_partial_products_sum_to_the_product(config, rows):
    x, w = torch.randn(rows, 200), torch.randn(90, 200)  # neither N nor K a multiple of the blocks
    parts = gemv.partial_products(x, w, config)
    assert parts.dtype == torch.float32 and parts.shape == (config.splits(200), rows, 90)
    assert config.split == 1 or parts.shape[0] > 1
    assert torch.allclose(parts.sum(0), F.linear(x, w), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("config", GEMV_CONFIGS[:2], ids=str)
def test_a_rows_product_does_not_depend_on_its_batch(config):
    x, w = torch.randn(20, 200), torch.randn(90, 200)
    x[7] = x[3]
    batch = gemv.partial_products(x, w, config)
    assert torch.equal(batch[:, 7], batch[:, 3])
    for r in (0, 3, 17):
        assert torch.equal(gemv.partial_products(x[r : r + 1], w, config)[:, 0], batch[:, r]), r
        assert torch.equal(gemv.partial_products(x[: r + 1], w, config)[:, r], batch[:, r]), r


def test_linear_matches_f_linear_and_refuses_a_split_config():
    x, w = torch.randn(3, 100), torch.randn(70, 100)
    assert torch.allclose(gemv.linear(x, w, gemv.GemvConfig(32, 32)), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert torch.allclose(gemv.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)  # the interpreter's own config
    with pytest.raises(ValueError, match="unsplit"):
        gemv.linear(x, w, gemv.GemvConfig(16, 16, split=4))


@pytest.mark.parametrize("rows", [1, 18])
def test_gate_up_silu_matches_silu_mul_of_the_two_products(rows):
    x, w = torch.randn(rows, 80), torch.randn(2 * 40, 80)
    expected = F.silu(F.linear(x, w[:40])) * F.linear(x, w[40:])
    got = gemv.gate_up_silu(x, w, gemv.GemvConfig(16, 32))
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-5)
    assert torch.equal(gemv.gate_up_silu(x[-1:], w, gemv.GemvConfig(16, 32))[0], got[-1])


def test_gemv_refuses_mismatched_operands():
    with pytest.raises(ValueError, match="gemv needs"):
        gemv.partial_products(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="gemv needs"):
        gemv.linear(torch.randn(2, 8), torch.randn(4, 8, dtype=torch.float64))


def test_add_rms_norm_sums_split_partial_products_in_order():
    x, w, residual = torch.randn(6, 64), torch.randn(96, 64), torch.randn(6, 96)
    parts = gemv.partial_products(x, w, gemv.GemvConfig(32, 16, split=4))
    assert parts.shape[0] == 4
    summed = parts[0] + parts[1] + parts[2] + parts[3]
    r1, r2, nw = residual.clone(), residual.clone(), torch.randn(96)
    assert torch.equal(kernels.rms_norm(parts, nw, 1e-6, r1), kernels.rms_norm(summed, nw, 1e-6, r2))
    assert torch.equal(r1, r2)
    with pytest.raises(ValueError, match="partial sums"):
        kernels.rms_norm(parts.double(), nw, 1e-6, residual.clone())


def test_qk_norm_rope_store_sums_split_partial_products():
    H, KVH, hd, S, L, N = 4, 2, 16, 3, 24, 5
    x, w = torch.randn(N, 48), torch.randn((H + 2 * KVH) * hd, 48)
    parts = gemv.partial_products(x, w, gemv.GemvConfig(32, 16, split=3))
    qw, kw = torch.randn(hd), torch.randn(hd)
    cos, sin = rope_tables(L, hd)
    rope_pos, slots, write_pos = torch.randint(0, L, (N,)), torch.randint(0, S, (N,)), torch.randperm(L)[:N]
    caches = [(torch.zeros(S, KVH, L, hd), torch.zeros(S, KVH, L, hd)) for _ in range(2)]
    summed = parts[0] + parts[1] + parts[2]
    outs = [kernels.qk_norm_rope_store(qkv, qw, kw, cos, sin, rope_pos, slots, write_pos, k, v, H, KVH, 1e-6)
            for qkv, (k, v) in zip((parts, summed), caches)]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("B", [1, 7, 40])
def test_advance_rows_in_one_launch_equals_the_pytorch_bookkeeping(B):
    S = 48
    g = torch.Generator().manual_seed(B)
    state = {"tokens": torch.randint(0, 50, (S,), generator=g),
             "positions": torch.randint(-1, 30, (S,), generator=g),  # -1: idle rows
             "counts": torch.randint(0, 10, (S,), generator=g),
             "budgets": torch.randint(1, 12, (S,), generator=g)}  # some rows reach theirs
    nxt = torch.randint(0, 12, (B,), generator=g)  # 10 and 11 are EOS ids: some rows end on one
    eos = torch.tensor([10, 11])
    runs = []
    for advance in (runner_module.advance_rows, kernels.advance_rows):
        st = {k: v.clone() for k, v in state.items()}
        out = torch.full((2, S), 7)
        advance(nxt, st["tokens"], st["positions"], st["counts"], st["budgets"], eos, out)
        runs.append((st, out))
    (ref, ref_out), (got, got_out) = runs
    assert torch.equal(got_out, ref_out) and all(torch.equal(got[k], ref[k]) for k in state)
    assert torch.equal(got["positions"][B:], state["positions"][B:])  # rows past B untouched
    assert (got_out[1, :B] == 1).any() or B == 1


# -- the decode step's ends as kernels (#16: decode_begin, the lm_head's argmax) ---------------------------------


def advance_state(S: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, 50, (S,), generator=g),
            "positions": torch.randint(-1, 30, (S,), generator=g),  # -1: idle rows
            "counts": torch.randint(0, 10, (S,), generator=g),
            "budgets": torch.randint(1, 12, (S,), generator=g)}  # some rows reach theirs


def advanced(advance, nxt, state: dict, eos: torch.Tensor) -> tuple[dict, torch.Tensor]:
    st = {k: v.clone() for k, v in state.items()}
    out = torch.full((2, st["tokens"].shape[0]), 7)
    advance(nxt, st["tokens"], st["positions"], st["counts"], st["budgets"], eos, out)
    return st, out


@pytest.mark.parametrize("B", [1, 5, 12])
def test_decode_begin_is_the_pytorch_start_of_the_step_bit_for_bit(B):
    V, D, scratch = 50, 96, 63
    embed, w = torch.randn(V, D), torch.randn(D)
    g = torch.Generator().manual_seed(B)
    tokens = torch.randint(0, V, (B,), generator=g)
    positions = torch.randint(-1, 40, (B,), generator=g)
    positions[-1] = -1  # a padding row of the bucket
    positions[0] = 0
    h, residual, rope_pos, slots, write_pos = kernels.decode_begin(tokens, positions, embed, w, 1e-6, scratch)
    # what TextDecoder.decode_inputs and FusedLayerOps.begin compute with PyTorch ops and kernels.rms_norm
    x = F.embedding(tokens, embed)
    assert torch.equal(residual, x)
    assert torch.equal(h, kernels.rms_norm(x.clone(), w, 1e-6))
    assert torch.allclose(h, norm_module(w)(x), atol=TOL, rtol=TOL)
    assert torch.equal(rope_pos, positions.clamp(min=0))
    assert torch.equal(write_pos, torch.where(positions >= 0, positions, scratch))
    assert torch.equal(slots, torch.arange(B))


def tied_products(rows: int, seed: int):
    """Small-integer operands: exact products with many equal maxima, within a column block and across blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (rows, 24), generator=g).float()
    w = torch.randint(-2, 3, (300, 24), generator=g).float()
    w[[9, 12, 40, 41, 200]] = 3.0  # equal rows: equal logits in one block and in later ones
    return x, w


@pytest.mark.parametrize("config", [gemv.GemvConfig(16, 16), gemv.GemvConfig(64, 32)], ids=str)
@pytest.mark.parametrize("rows", [1, 6, 20])  # 20: two row tiles
def test_linear_argmax_keeps_the_logits_and_its_maxima_give_torch_argmax_ties_included(config, rows):
    x, w = tied_products(rows, seed=rows)
    x[0] = 1.0  # row 0's maximum is the tie of columns 9, 12 (one block), 40, 41 and 200
    logits, maxima = gemv.linear_argmax(x, w, config)
    assert torch.equal(logits, gemv.linear(x, w, config))
    blocks = -(-300 // config.block_n)
    assert maxima.values.shape == maxima.index.shape == (rows, blocks) and maxima.index.dtype == torch.int32
    state, eos = advance_state(rows + 3, seed=rows), torch.tensor([10, 11])
    state["positions"][:rows] = torch.arange(rows)  # every row live: each one's token shows in out[0]
    expected = advanced(runner_module.advance_rows, logits.argmax(dim=-1), state, eos)
    got = advanced(kernels.advance_rows, maxima, state, eos)
    assert torch.equal(got[1], expected[1]) and all(torch.equal(got[0][k], expected[0][k]) for k in state)
    assert int(got[1][0, 0]) == 9


def test_the_fused_argmax_takes_nans_and_infinities_as_torch_argmax_does():
    x, w = tied_products(4, seed=3)
    w[[70, 150]] = 0.0
    w[70, 0], w[150, 0] = float("inf"), float("-inf")
    x[:, 0] = torch.tensor([1.0, 0.0, -1.0, 2.0])  # column 70: +inf, NaN (0 * inf), -inf, +inf; 150: the opposite
    logits, maxima = gemv.linear_argmax(x, w, gemv.GemvConfig(16, 16))
    state = advance_state(4, seed=4)
    state["positions"][:] = torch.arange(4)
    state["budgets"][:] = 100
    eos = torch.tensor([-1])
    expected = advanced(runner_module.advance_rows, logits.argmax(dim=-1), state, eos)
    got = advanced(kernels.advance_rows, maxima, state, eos)
    assert torch.equal(got[1], expected[1])
    assert got[1][0].tolist() == [70, 70, 150, 70]  # a NaN is the largest, and the first of two NaNs wins


def test_block_maxima_reduce_across_many_blocks_to_the_first_maximum():
    # more block maxima than advance_rows reduces at once (ARGMAX_BLOCK): the first maximum sits in a later pass too
    step = kernels.ARGMAX_BLOCK
    rows, blocks = 3, 2 * step + 500
    values = torch.randn(rows, blocks)
    values[0, [5, step + 1500, 2 * step + 400]] = 10.0
    values[1, [step + 2000, 2 * step + 300]] = 10.0
    values[2, :] = float("-inf")
    index = (torch.arange(blocks, dtype=torch.int32) * 16 + 3).repeat(rows, 1).contiguous()
    state = advance_state(rows, seed=5)
    state["positions"][:] = 1
    state["budgets"][:] = 100
    _, out = advanced(kernels.advance_rows, kernels.BlockMaxima(values, index), state, torch.tensor([-1]))
    assert out[0].tolist() == [5 * 16 + 3, (step + 2000) * 16 + 3, 3]


# -- the engine on the kernels ---------------------------------------------------------------------------------------


def speech(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    f0 = rng.uniform(100, 250)
    voiced = sum(np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 6)) / k for k in range(1, 5))
    return (0.2 * voiced + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    opts = dict(num_slots=4, max_len=256, num_retained=2)
    fused = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(**opts, fused_kernels=True))
    plain = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(**opts, fused_kernels=False))
    assert isinstance(fused.runner.layer_ops, FusedLayerOps) and isinstance(plain.runner.layer_ops, PlainLayerOps)
    return fused, plain


def test_engine_on_kernels_gives_the_plain_engines_tokens(engines):
    fused, plain = engines
    clips = [speech(s, seed=i) for i, s in enumerate([0.4, 2.2, 3.1, 1.3, 0.9, 2.8])]
    budgets = [6, 12, 9, 15, 7, 11]
    reqs = [DecodeRequest(audio=c, max_new_tokens=b) for c, b in zip(clips, budgets)]  # 6 requests, 4 slots
    got, expected = fused.transcribe(reqs), plain.transcribe(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert all(len(r.token_ids) == b for r, b in zip(got, budgets))


def test_the_engine_on_the_fused_first_convolution_gives_the_plain_engines_tokens(tiny_model_dir, engines,
                                                                                   monkeypatch):
    _, plain = engines
    monkeypatch.setenv(runner_module.FUSED_CONV1_ENV, "1")  # read when a runner is made
    fused = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(
        num_slots=2, max_len=256, num_retained=0, fused_kernels=True))
    assert fused.runner.embed_conv_chunks.keywords["first_conv"] is conv_kernels.conv1_gelu
    req = DecodeRequest(audio=speech(1.3, seed=3), max_new_tokens=4)  # two chunks: one whole, one padded
    assert fused.transcribe([req])[0].token_ids == plain.transcribe([req])[0].token_ids
    assert fused.runner.conv_chunks_run == 2


def test_decode_streams_small_products_through_gemv_and_larger_ones_through_cublas(engines, monkeypatch):
    fused, plain = engines
    calls = []
    for name in ("partial_products", "linear", "linear_argmax", "gate_up_silu"):
        real = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda x, *a, real=real, name=name, **k: calls.append((name, x.shape[0]))
                            or real(x, *a, **k))
    reqs = [DecodeRequest(audio=speech(s, seed=40 + i), max_new_tokens=5) for i, s in enumerate([0.6, 1.4, 2.0])]
    expected = [r.token_ids for r in plain.transcribe(reqs)]
    assert [r.token_ids for r in fused.transcribe(reqs)] == expected
    names = {name for name, _ in calls}
    assert {"partial_products", "gate_up_silu"} <= names and names & {"linear", "linear_argmax"}
    # the lm_head of the 4-row decode bucket: linear_argmax where the runner's step takes the greedy tokens from it
    # (decode_greedy), linear where it takes the logits' argmax
    assert 4 in {rows for name, rows in calls if name in ("linear", "linear_argmax")}
    calls.clear()
    monkeypatch.setattr(fused.runner.layer_ops, "gemv_rows", 0)  # $QASR_DECODE_GEMV=0: cuBLAS for every product
    assert [r.token_ids for r in fused.transcribe(reqs)] == expected
    assert calls == []


def test_prefill_padded_to_buckets_gives_the_same_tokens(tiny_model_dir, engines):
    _, plain = engines
    padded = Engine.from_pretrained(str(tiny_model_dir), device="cpu",
                                    options=EngineOptions(num_slots=4, max_len=256, num_retained=2, fused_kernels=True))
    padded.runner.build_prefill_buckets(capture=False)  # the graphed path's padding, run eagerly
    assert [(b, t) for _, b, t in runner_module.prefill_replays([30, 100, 64], runner_module.PREFILL_BATCH_BUCKETS,
                                                                   padded.runner.prefill_lengths)] == [(4, 112)]
    clips = [speech(s, seed=20 + i) for i, s in enumerate([0.7, 2.5, 1.1])]
    reqs = [DecodeRequest(audio=c, max_new_tokens=8) for c in clips]
    lengths = []
    prefill = padded.runner.prefill
    padded.runner.prefill = lambda embeds, *a: lengths.append([e.shape[0] for e in embeds]) or prefill(embeds, *a)
    assert [r.token_ids for r in padded.transcribe(reqs)] == [r.token_ids for r in plain.transcribe(reqs)]
    del padded.runner.prefill
    # one admission of three: a bucket of four sequences, each padded to the longest's rung of the length ladder
    assert len(lengths) == 1 and padded.counters["prefill_tokens"] == sum(lengths[0])
    longest = runner_module.bucket_of(max(lengths[0]), padded.runner.prefill_lengths)
    assert padded.counters["prefill_computed_tokens"] == 4 * longest < 4 * (-(-max(lengths[0]) // 64) * 64)
    assert [padded.transcribe([r])[0].token_ids for r in reqs] == [r.token_ids for r in plain.transcribe(reqs)]


def test_the_engine_on_an_int8_cache_gives_the_plain_int8_engines_tokens_and_identical_rows(tiny_model_dir, engines):
    """kv_int8 on the kernels (the writer and both readers) against the plain path over the same format; a bf16
    engine's tokens differ (tested elsewhere only through docs/benchmarks.md's agreement figures)."""
    fused, plain = (Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(
        num_slots=4, max_len=256, num_retained=2, kv_int8=True, fused_kernels=on)) for on in (True, False))
    assert fused.runner.cache.int8 and fused.runner.cache.k[0].dtype == torch.int32
    clips = [speech(s, seed=60 + i) for i, s in enumerate([0.4, 2.2, 3.1, 1.3, 0.9])]
    reqs = [DecodeRequest(audio=c, max_new_tokens=b) for c, b in zip(clips, [6, 12, 9, 15, 7])]  # 5 requests, 4 slots
    assert [r.token_ids for r in fused.transcribe(reqs)] == [r.token_ids for r in plain.transcribe(reqs)]
    out = fused.transcribe([DecodeRequest(audio=clips[1], max_new_tokens=10) for _ in range(4)])
    assert len({r.token_ids for r in out}) == 1 and len(out[0].token_ids) == 10
    clip = speech(9.0, seed=4)  # partials reusing a prefix: the copy takes the scales along
    for seconds in (3.0, 8.5, 9.0):
        req = DecodeRequest(audio=clip[: int(seconds * 16000)], priority=Priority.PARTIAL, stream_id="s",
                            max_new_tokens=6)
        assert fused.transcribe([req])[0].token_ids == plain.transcribe([req])[0].token_ids
    assert fused.counters["reused_tokens"] > 0


@pytest.mark.parametrize("int8", [False, True])
def test_a_runners_prefix_copy_copies_every_layers_keys_and_values(tiny_model_dir, int8):
    """A stream's retained prefix (copy_prefix): the first `length` positions of every cache tensor, nothing past."""
    runner = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(
        num_slots=2, max_len=64, num_retained=1, fused_kernels=True, kv_int8=int8)).runner
    cache = runner.cache
    tensors = cache.tensors
    assert len(tensors) == (4 if int8 else 2) * len(cache.k)  # keys and values per layer, and an int8 cache's scales
    for t in tensors:
        t[0] = torch.rand(t[0].shape) if t.is_floating_point() else torch.randint(-2**31, 2**31 - 1, t[0].shape)
    runner.copy_prefix(0, 2, 20)
    for t in tensors:
        assert torch.equal(t[2, :, :20], t[0, :, :20]) and not t[2, :, 20:].any()


def test_an_admission_larger_than_the_largest_bucket_is_prefilled_in_chunks(tiny_model_dir, engines, monkeypatch):
    _, plain = engines
    monkeypatch.setattr(runner_module, "PREFILL_BATCH_BUCKETS", (1, 2))  # 4 sequences: two chunks of two
    chunked = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(
        num_slots=4, max_len=256, num_retained=2, fused_kernels=True))
    chunked.runner.build_prefill_buckets(capture=False)
    runs = []
    for bucket in chunked.runner.prefill_buckets.values():
        monkeypatch.setattr(bucket, "run",
                            lambda embeds, meta, run=bucket.run: runs.append(meta[2]) or run(embeds, meta))
    reqs = [DecodeRequest(audio=speech(s, seed=30 + i), max_new_tokens=4) for i, s in enumerate([2.0, 0.5, 1.5, 0.8])]
    assert [r.token_ids for r in chunked.transcribe(reqs)] == [r.token_ids for r in plain.transcribe(reqs)]
    assert len(runs) == 2 and all(len(lengths) == 2 for lengths in runs)
    assert max(runs[0]) <= min(runs[1])  # similar lengths share a chunk: the short ones first


def test_graph_capture_code_runs_every_bucket_once_per_group_pool(tiny_model_dir, monkeypatch):
    """The capture code only runs on CUDA; here torch.cuda's graph API is stood in for, so that its Python runs in CI:
    every decode, encoder, conv front-end and prefill bucket is warmed up and recorded, each group into one pool of its own."""

    recorded = []  # (pool passed in, graph) per recording

    class FakeGraph:
        def __init__(self):
            self.handle = object()

        def pool(self):
            return self.handle

    class FakeStream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None):
        recorded.append((pool, graph))
        yield

    for name, value in {"CUDAGraph": FakeGraph, "graph": fake_graph, "Stream": FakeStream,
                        "current_stream": FakeStream, "stream": lambda s: contextlib.nullcontext(),
                        "synchronize": lambda: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    # fewer buckets: the interpreter is slow (and the conv graphs capture PyTorch's first convolution here, as every
    # engine of these cases but one does: the capture code is the same)
    monkeypatch.setattr(runner_module, "ENCODER_BUCKETS", (1, 2))
    monkeypatch.setattr(runner_module, "CONV_BUCKETS", (1, 2))
    monkeypatch.setattr(runner_module, "PREFILL_BATCH_BUCKETS", (1, 2))
    model = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(
        num_slots=4, max_len=64, num_retained=0, fused_kernels=True)).model
    runner = runner_module.ModelRunner(model, num_slots=4, max_len=32, cuda_graphs=True, fused_kernels=True)

    assert list(runner.graphs) == [4, 2, 1]
    assert sorted(runner.encoder_graphs) == [(n, W) for n in (32, 56, 104) for W in runner_module.ENCODER_BUCKETS]
    # prefill lengths by 16 up to max_len 32
    prefill = [(b, t) for b in runner_module.PREFILL_BATCH_BUCKETS for t in (16, 32)]
    assert sorted(runner.prefill_buckets) == prefill
    assert all(bucket.graph is not None and bucket.first is not None for bucket in runner.prefill_buckets.values())
    assert sorted(runner.conv_graphs) == [1, 2]
    groups = [3, 3 * len(runner_module.ENCODER_BUCKETS), len(runner_module.CONV_BUCKETS), len(prefill)]
    assert len(recorded) == sum(groups)
    start = 0
    for size in groups:  # the first graph of a group opens its pool, the others share it
        (first_pool, first_graph), *rest = recorded[start : start + size]
        assert first_pool is None and all(pool is first_graph.handle for pool, _ in rest)
        start += size


def test_identical_inputs_give_identical_rows_on_kernels(engines):
    fused, _ = engines
    clip = speech(1.7, seed=9)
    out = fused.transcribe([DecodeRequest(audio=clip, max_new_tokens=10) for _ in range(4)])
    assert len({r.token_ids for r in out}) == 1 and len(out[0].token_ids) == 10


@pytest.fixture()
def step_runner(engines):
    """A fused runner of the tiny model, its cache random, rows in every state: live, finishing on their budget,
    idle (-1), and the bucket's padding row."""
    model = engines[0].model
    runner = runner_module.ModelRunner(model, num_slots=6, max_len=64, fused_kernels=True, cuda_graphs=False,
                                       eos_ids=(5,))
    for layer in (*runner.cache.k, *runner.cache.v):
        layer.normal_()
    runner.tokens.copy_(torch.randint(0, model.cfg.text.vocab_size, (6,)))
    runner.positions.copy_(torch.tensor([0, 17, -1, 40, 3, -1]))
    runner.counts.copy_(torch.tensor([1, 3, 0, 2, 9, 0]))
    runner.budgets.copy_(torch.tensor([20, 20, 20, 20, 10, 20]))  # row 4 reaches its budget
    return runner


def greedy_step(runner, B: int, ops) -> torch.Tensor:
    """One decode step of rows [0, B) on layer ops `ops` as the runner's _step takes it (decode_greedy, then
    kernels.advance_rows) -> its logits."""
    logits, nxt = runner.model.decoder.decode_greedy(runner.tokens[:B], runner.positions[:B], runner.cache, ops)
    kernels.advance_rows(nxt, runner.tokens, runner.positions, runner.counts, runner.budgets, runner.eos, runner.out)
    return logits


def run_step(runner, B: int, ops) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """greedy_step on a copy of the runner's state and cache -> (logits, the state after)."""
    kept = (runner.tokens, runner.positions, runner.counts, runner.budgets, runner.out, *runner.cache.k,
            *runner.cache.v)
    saved = [t.clone() for t in kept]
    logits = greedy_step(runner, B, ops)
    after = [t.clone() for t in (runner.tokens, runner.positions, runner.counts, runner.out, *runner.cache.k,
                                 *runner.cache.v)]
    for t, s in zip(kept, saved):
        t.copy_(s)
    return logits, after


# PyTorch ops that launch nothing: allocations (views are told by their schema)
NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "lift_fresh",
             "detach", "alias", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous"}


def is_view(func) -> bool:
    """Whether a PyTorch op returns a view of an input (its schema says its output aliases an input, unwritten)."""
    return any(a.alias_info is not None and not a.alias_info.is_write for a in func._schema.arguments)


@contextlib.contextmanager
def recorded_launches():
    """The kernels launched inside, in order, as the host launches them (on the CPU too, where the Triton kernels
    run in the interpreter): kernels.py's and gemv.py's Triton kernels by name, and every PyTorch op that runs a
    kernel as "aten.<op>" (views and allocations launch none). Yields the list, filled as they launch."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        InterpretedFunction = JITFunction
    launched: list[str] = []
    inside_triton = [False]  # the interpreter's own tensor work inside a Triton launch is not a launch

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside_triton[0] and not is_view(func) and name not in NO_LAUNCH:
                launched.append(f"aten.{name}")
            return func(*args, **(kwargs or {}))

    class Counted:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append(self.name)
                inside_triton[0] = True
                try:
                    return self.fn[grid](*args, **kw)
                finally:
                    inside_triton[0] = False

            return launch

    kinds = (JITFunction, InterpretedFunction)
    swapped = [(module, name, value) for module in (kernels, gemv) for name, value in vars(module).items()
               if isinstance(value, kinds) and name.endswith("_kernel")]  # launched kernels, not device functions
    for module, name, value in swapped:
        setattr(module, name, Counted(name, value))
    try:
        with Ops():
            yield launched
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)


def launch_summary(launched: list[str]) -> dict:
    """recorded_launches' list -> launches, Triton kernels, PyTorch ops by name, and Triton chain breaks (a Triton
    kernel after a PyTorch op: PDL does not overlap it with what came before)."""
    torch_ops: dict[str, int] = {}
    for name in launched:
        if name.startswith("aten."):
            torch_ops[name] = torch_ops.get(name, 0) + 1
    breaks = sum(1 for i, n in enumerate(launched) if not n.startswith("aten.") and i > 0
                 and launched[i - 1].startswith("aten."))
    return {"launches": len(launched), "triton": len(launched) - sum(torch_ops.values()), "torch_ops": torch_ops,
            "chain_breaks": breaks}


@pytest.mark.parametrize("B", [1, 4, 6])
def test_the_kernels_step_is_the_plain_pytorch_step(step_runner, B):
    # logits to float32 rounding, the same tokens and state (rows live, finishing on their budget, idle, padding)
    runner = step_runner
    logits, after = run_step(runner, B, runner.layer_ops)
    plain_logits, plain_after = run_step(runner, B, PlainLayerOps())
    assert torch.allclose(logits, plain_logits, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(after[:4], plain_after[:4]))
    live = runner.positions[:B] >= 0
    assert torch.equal(after[3][0, :B][~live], torch.full_like(after[3][0, :B][~live], -1))  # idle rows: no token


def test_the_step_launches_no_pytorch_op_where_its_products_are_gemv(step_runner):
    runner = step_runner
    layers = runner.model.cfg.text.num_hidden_layers
    cublas = FusedLayerOps(runner.model.decoder.rope_table(runner.cache.length), gemv_rows=0)  # as above 32 rows
    counts = {}
    for name, ops in (("gemv", runner.layer_ops), ("cublas", cublas)):
        with recorded_launches() as launched:
            greedy_step(runner, 4, ops)
        counts[name] = launch_summary(launched)
        assert launched[-1] == "_advance_rows_kernel"
    # per layer: add+RMSNorm, qkv, q/k-norm+RoPE+KV write, attention, o_proj, add+RMSNorm, gate_up+SiLU, down;
    # then the step's start, the lm_head, the bookkeeping: one chain of Triton kernels
    assert counts["gemv"] == {"launches": 8 * layers + 3, "triton": 8 * layers + 3, "torch_ops": {}, "chain_breaks": 0}
    # with the products on cuBLAS (the step above 32 rows) they are PyTorch ops, and so is the argmax: the recording
    # sees each, and the Triton kernel after each is a break (qkv, o_proj, gate_up and down a layer; the lm_head)
    assert counts["cublas"] == {"launches": 9 * layers + 4, "triton": 5 * layers + 2,
                                "torch_ops": {"aten.mm": 4 * layers + 1, "aten.argmax": 1},
                                "chain_breaks": 4 * layers + 1}, counts["cublas"]


def test_partials_reusing_a_prefix_on_kernels_match_the_plain_engine(engines):
    fused, plain = engines
    clip = speech(9.0, seed=4)
    before = dict(fused.counters)
    for seconds in (3.0, 8.5, 9.0):  # the later partials copy the first whole window's KV
        req = DecodeRequest(audio=clip[: int(seconds * 16000)], priority=Priority.PARTIAL, stream_id="s", max_new_tokens=6)
        (a,) = fused.transcribe([req])
        (b,) = plain.transcribe([req])
        assert a.token_ids == b.token_ids
    assert fused.counters["reused_tokens"] > before["reused_tokens"]


# -- FP8 prefill products (model/fp8.py): the kernels that quantize for them, and the engine's prefill on them ------

if kernels.triton is not None:

    @kernels.triton.jit
    def _e4m3_probe(X, Q, S, D, BLOCK: tl.constexpr):
        # kernels._store_e4m3 on one float32 row of D values
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        kernels._store_e4m3(tl.load(X + cols, mask=mask, other=0.0), Q, S, 0, cols, mask, D)


def same_rows(got: tuple[torch.Tensor, torch.Tensor], expected: fp8.Rows) -> None:
    values, scales = got
    assert values.dtype == fp8.E4M3 and scales.shape == expected.scales.shape
    assert torch.equal(scales, expected.scales)
    assert torch.equal(values.view(torch.uint8), expected.values.view(torch.uint8))  # bit for bit, -0 included


def test_the_fp8_store_rounds_every_e4m3_value_and_every_tie_as_pytorchs_cast():
    values = torch.arange(256, dtype=torch.uint8).view(fp8.E4M3).float()
    values = values[values.isfinite()].sort().values
    ties = (values[:-1] + values[1:]) / 2  # round to nearest even: subnormals and exponent carries included
    row = torch.cat([values, ties, -ties, torch.tensor([448.0, -0.0, 1e-9, -1e-9, 3e-3, -3e-3])])
    for x in (row, row * 2.0 ** -20, torch.zeros(7)):  # scale 1; a tiny row; a padding row (MIN_SCALE)
        q = torch.empty(x.numel(), dtype=fp8.E4M3)
        s = torch.empty(1, 1)
        _e4m3_probe[(1,)](x, q, s, x.numel(), BLOCK=kernels.triton.next_power_of_2(x.numel()))
        same_rows((q[None], s), fp8.quantize_rows(x[None]))


@pytest.mark.parametrize("residual", [False, True])
def test_the_fp8_rms_norm_stores_the_quantized_rows_of_the_norms_output(residual):
    x, w = 3 * torch.randn(6, 96), torch.randn(96)
    x[2] = 0  # a padding row
    r1, r2 = (torch.randn(6, 96), torch.randn(6, 96)) if residual else (None, None)
    if residual:
        r2.copy_(r1)
    same_rows(kernels.rms_norm(x, w, 1e-6, r1, fp8=True), fp8.quantize_rows(kernels.rms_norm(x, w, 1e-6, r2)))
    if residual:
        assert torch.equal(r1, r2)  # the residual stream is updated as before


def test_the_fp8_rms_norm_sums_split_partial_products_first():
    x, w, residual = torch.randn(6, 64), torch.randn(96, 64), torch.randn(6, 96)
    parts = gemv.partial_products(x, w, gemv.GemvConfig(32, 16, split=4))
    nw = torch.randn(96)
    same_rows(kernels.rms_norm(parts, nw, 1e-6, residual.clone(), fp8=True),
              fp8.quantize_rows(kernels.rms_norm(parts, nw, 1e-6, residual.clone())))


def test_the_fp8_silu_mul_stores_the_quantized_rows_of_its_product():
    gate_up = 4 * torch.randn(3, 2 * 1500)  # a row wider than the bf16 kernel's column block
    same_rows(kernels.silu_mul(gate_up, fp8=True), fp8.quantize_rows(kernels.silu_mul(gate_up)))


@pytest.fixture(scope="module")
def fp8_engine(tiny_model_dir):
    return Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(
        num_slots=4, max_len=256, num_retained=2, fused_kernels=True, fp8_prefill=True))


def test_fp8_prefill_multiplies_three_products_a_layer_in_fp8_and_decode_steps_none(fp8_engine, engines,
                                                                                    monkeypatch):
    """Every prefill's qkv, gate_up and down take their input from the kernel before them as e4m3 rows; the decode
    steps run the ops without FP8, so once the prefill is the same the decode is too: bf16 weights, bf16 products."""
    runner = fp8_engine.runner
    layers = len(runner.model.decoder.layers)
    assert runner.fp8_products == 3 * layers and not runner.layer_ops.fp8_products and runner.prefill_ops.fp8_products
    inputs = []
    linear = fp8.linear
    monkeypatch.setattr(fp8, "linear", lambda x, layer: inputs.append((x, layer)) or linear(x, layer))
    out = fp8_engine.transcribe([DecodeRequest(audio=speech(1.1, seed=70), max_new_tokens=5)])
    decoder = runner.model.decoder
    products = [p for l in decoder.layers for p in (l.self_attn.qkv_proj, l.mlp.gate_up_proj, l.mlp.down_proj)]
    assert sorted(map(id, (layer for _, layer in inputs))) == sorted(map(id, products))  # one prefill, each once
    assert all(isinstance(x, fp8.Rows) and x.values.dtype == fp8.E4M3 for x, _ in inputs)
    assert len(out[0].token_ids) == 5
    fused, _ = engines  # its own model: fp8.attach marked only fp8_engine's
    assert not any(l.input_layernorm.feeds_fp8 for l in fused.runner.model.decoder.layers)


def test_fp8_prefill_keeps_rows_independent_of_their_batch(fp8_engine):
    """Every prefill is FP8, whatever its size: a clip decodes the same alone, beside others, and beside copies of
    itself (per-row scales)."""
    clips = [speech(s, seed=80 + i) for i, s in enumerate([0.4, 2.2, 3.1, 1.3, 0.9])]
    reqs = [DecodeRequest(audio=c, max_new_tokens=b) for c, b in zip(clips, [6, 12, 9, 15, 7])]  # 5 requests, 4 slots
    batched = [r.token_ids for r in fp8_engine.transcribe(reqs)]
    assert batched == [fp8_engine.transcribe([r])[0].token_ids for r in reqs]
    copies = fp8_engine.transcribe([DecodeRequest(audio=clips[1], max_new_tokens=12) for _ in range(4)])
    assert [r.token_ids for r in copies] == [batched[1]] * 4


def test_the_encoder_layer_norm_and_gelu_kernels_match_pytorch_and_quantize_their_rows():
    x, w, b = 3 * torch.randn(6, 96) + 1, torch.randn(96), torch.randn(96)
    x[2] = 0  # a padding row: its output is the bias
    y = kernels.layer_norm(x, w, b, 1e-5)
    torch.testing.assert_close(y, F.layer_norm(x, (96,), w, b, 1e-5), atol=1e-5, rtol=1e-5)
    same_rows(kernels.layer_norm(x, w, b, 1e-5, fp8=True), fp8.quantize_rows(y))
    g = 4 * torch.randn(3, 1500)  # rows of a width that is not a power of two, as the encoder's ffn (3,584)
    torch.testing.assert_close(kernels.gelu(g), F.gelu(g), atol=1e-5, rtol=1e-5)
    same_rows(kernels.gelu(g, fp8=True), fp8.quantize_rows(kernels.gelu(g)))


@pytest.fixture(scope="module")
def fp8_encoder_engine(tiny_model_dir):
    return Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(
        num_slots=4, max_len=256, num_retained=2, fused_kernels=True, fp8_encoder=True))


def test_fp8_encoder_multiplies_five_products_a_layer_in_fp8_and_keeps_windows_independent(fp8_encoder_engine,
                                                                                           monkeypatch):
    """q/k/v, fc1 and fc2 take e4m3 rows from the LayerNorm or GELU kernel before them; the output stays near the
    plain encoder's (FP8 moves it a little, not to noise) and a window's rows do not depend on the windows beside it."""
    runner = fp8_encoder_engine.runner
    encoder = runner.model.encoder
    assert runner.fp8_encoder_products == 5 * len(encoder.layers) and runner.fp8_products == 0
    inputs = []
    linear = fp8.linear
    monkeypatch.setattr(fp8, "linear", lambda x, layer: inputs.append((x, layer)) or linear(x, layer))
    T, D = encoder.cfg.window_tokens, encoder.cfg.d_model
    windows, lengths = torch.randn(3, T, D), torch.tensor([T, T - 3, 5])
    got = runner.encode_windows(windows, lengths)
    assert len(inputs) == 5 * len(encoder.layers)
    assert all(isinstance(x, fp8.Rows) and x.values.dtype == fp8.E4M3 for x, _ in inputs)
    assert {id(layer) for _, layer in inputs} == {id(l.get_submodule(n)) for l in encoder.layers
                                                  for n in fp8.ENCODER_PRODUCTS}
    plain = encoder.encode_windows(windows, lengths)
    for w, n in enumerate(lengths.tolist()):
        error = (got[w, :n] - plain[w, :n]).norm() / plain[w, :n].norm()
        assert 0 < error < 0.1, error
        alone = runner.encode_windows(windows[w : w + 1], lengths[w : w + 1])
        assert torch.equal(alone[0, :n], got[w, :n])


def test_fp8_encoder_engine_decodes_a_clip_the_same_alone_and_beside_others(fp8_encoder_engine):
    clips = [speech(s, seed=90 + i) for i, s in enumerate([0.4, 2.2, 3.1, 1.3, 0.9])]
    reqs = [DecodeRequest(audio=c, max_new_tokens=b) for c, b in zip(clips, [6, 12, 9, 15, 7])]  # 5 requests, 4 slots
    batched = [r.token_ids for r in fp8_encoder_engine.transcribe(reqs)]
    assert all(batched) and batched == [fp8_encoder_engine.transcribe([r])[0].token_ids for r in reqs]


def test_the_gpu_kernel_checks_fp8_section_compares_the_kernels_with_pytorch(fp8_engine, monkeypatch):
    from qasr.bench import kernel_check

    layer = fp8_engine.runner.model.decoder.layers[0]
    cpu = torch.device("cpu")
    with torch.no_grad():
        r = kernel_check.fp8_agreement(layer, kernel_check.fp8_products(layer), 5, cpu)
    exact = {"values_identical": 1.0, "scales_identical": 1.0}
    assert r["input_norm"] == r["post_norm_partials"] == r["silu_mul"] == exact
    for name in ("qkv_proj", "gate_up_proj", "down_proj"):
        assert 0 < r[f"{name}_relative_rms"] < 0.1  # FP8 is near the bf16 product, not equal to it
    # a quantizing norm that left out its residual is caught
    rms_norm = kernels.rms_norm
    monkeypatch.setattr(kernels, "rms_norm", lambda x, w, eps, residual=None, fp8=False:
                        rms_norm(x, w, eps, None if fp8 else residual, fp8=fp8))
    with torch.no_grad():
        wrong = kernel_check.fp8_agreement(layer, kernel_check.fp8_products(layer), 5, cpu)
    assert wrong["input_norm"]["values_identical"] < 0.5 and wrong["silu_mul"] == exact


def test_the_gpu_kernel_checks_fp8_section_compares_the_encoders_kernels_with_pytorch(fp8_engine, monkeypatch):
    from qasr.bench import kernel_check

    layer = fp8_engine.runner.model.encoder.layers[0]
    with torch.no_grad():
        r = kernel_check.fp8_encoder_agreement(layer, 5, torch.device("cpu"))
    exact = {"values_identical": 1.0, "scales_identical": 1.0}
    assert r["layer_norm_fp8"] == r["gelu_fp8"] == exact
    # float32 here, where the kernel's sums and PyTorch's round differently (the GPU check runs bfloat16); a kernel
    # that left out a term would match in no element
    assert r["layer_norm_vs_pytorch"] > 0.25 and r["gelu_vs_pytorch"] > 0.5
    assert 0 < r["fc1_relative_rms"] < 0.1 and 0 < r["fc2_relative_rms"] < 0.1
    # a product that left out its bias is caught
    linear = fp8.linear
    monkeypatch.setattr(fp8, "linear", lambda x, layer: linear(x, SimpleNamespace(**{**vars(layer), "bias": None})))
    with torch.no_grad():
        wrong = kernel_check.fp8_encoder_agreement(layer, 5, torch.device("cpu"))
    assert wrong["fc1_relative_rms"] > 0.1 or wrong["fc2_relative_rms"] > 0.1


def test_the_gpu_kernel_checks_fp8_times_run_each_piece_each_way(fp8_engine, monkeypatch):
    """Timing needs a GPU (graphs): here each timed call runs once, and the FP8 chain must multiply in FP8."""
    from qasr.bench import kernel_check

    ran = []
    monkeypatch.setattr(kernel_check, "per_call_ms", lambda calls: [call() for call in calls] and 1e-3)
    linear = fp8.linear
    monkeypatch.setattr(fp8, "linear", lambda x, layer: ran.append(layer) or linear(x, layer))
    with torch.no_grad():
        layer = fp8_engine.runner.model.decoder.layers[0]
        times = kernel_check.fp8_times_us(layer, kernel_check.fp8_products(layer), 3, torch.device("cpu"))
    pieces = ("rms_norm", "silu_mul", "chain", "qkv_proj", "gate_up_proj", "down_proj")
    assert times == {f"{piece} {kind}": 1.0 for piece in pieces for kind in ("bf16", "fp8")}
    assert len(ran) == 4 * (3 + 3)  # 4 calls each: the FP8 chain's three products and the three FP8 products


def test_fp8_prefill_is_refused_without_the_fused_kernels(tiny_model_dir):
    with pytest.raises(ValueError, match="fused kernels"):
        Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(
            num_slots=2, max_len=64, num_retained=0, fused_kernels=False, fp8_prefill=True))


def test_fp8_prefill_hidden_states_stay_near_the_plain_pytorch_ones(fp8_engine):
    model = fp8_engine.runner.model
    embeds = torch.randn(2, 40, model.cfg.text.hidden_size)
    slots, starts, lengths = torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long), torch.tensor([40, 33])
    hidden = {}
    for name, ops in (("fp8", fp8_engine.runner.prefill_ops), ("plain", PlainLayerOps())):
        hidden[name] = model.decoder.prefill(embeds, slots, starts, lengths, model.new_cache(2, 64), ops)
    valid = torch.arange(40)[None, :] < lengths[:, None]
    got, expected = hidden["fp8"][valid], hidden["plain"][valid]
    # e4m3 keeps 3 mantissa bits (each operand within 1/16): a few percent over two layers, and not nothing
    assert 0 < float((got - expected).norm() / expected.norm()) < 0.08


def test_attaching_fp8_weights_again_keeps_the_ones_captured_graphs_read(fp8_engine):
    """Engines that share one model (bench/engine_ab) each attach it; a second attach must not swap the buffers, or
    the first engine's CUDA graphs would read freed memory."""
    model = fp8_engine.runner.model
    before = [(l.self_attn.qkv_proj.weight_fp8, l.mlp.down_proj.weight_scale) for l in model.decoder.layers]
    assert fp8.attach(model) == fp8_engine.runner.fp8_products
    after = [(l.self_attn.qkv_proj.weight_fp8, l.mlp.down_proj.weight_scale) for l in model.decoder.layers]
    assert all(a is b for pair in zip(before, after) for a, b in zip(*pair))


# -- FP8 weights in the GEMVs; the lm_head rounded to FP8 (model/fp8_lm_head.py) ------------------------------------


def rounded_operands(rows: int, N: int, K: int):
    """x [rows, K] and a weight [N, K] rounded to FP8, its rows' magnitudes decades apart (scales of their own)."""
    x = torch.randn(rows, K)
    return x, fp8_lm_head.round_weight(torch.randn(N, K) * torch.logspace(-3, 1, N)[:, None])


@pytest.mark.parametrize("config", GEMV_CONFIGS + [None], ids=str)
def test_a_gemv_over_fp8_weights_is_the_gemv_over_their_image_bit_for_bit(config):
    """The scale is a power of two, so scaling the sums equals summing the scaled weights, rounding included."""
    x, r = rounded_operands(5, 96, 64)
    got = gemv.partial_products(x, r.values, config, scale=r.scales)
    assert torch.equal(got, gemv.partial_products(x, r.image, config))
    assert not torch.equal(got, gemv.partial_products(x, r.values.float(), config))  # the scales were applied
    if config is None or config.split == 1:
        logits, maxima = gemv.linear_argmax(x, r.values, config, scale=r.scales)
        expected_logits, expected = gemv.linear_argmax(x, r.image, config)
        assert torch.equal(logits, expected_logits) and torch.equal(logits, gemv.linear(x, r.values, config,
                                                                                        scale=r.scales))
        assert torch.equal(maxima.values, expected.values) and torch.equal(maxima.index, expected.index)


def test_an_fp8_weight_comes_with_its_scales_and_only_it_takes_them():
    x, r = rounded_operands(2, 32, 32)
    with pytest.raises(ValueError, match="FP8 weight needs its scales"):
        gemv.linear(x, r.values)
    with pytest.raises(ValueError, match="FP8 weight needs its scales"):
        gemv.linear(x, r.image, scale=r.scales)
    with pytest.raises(ValueError, match="float32 scales"):
        gemv.linear(x, r.values, scale=r.scales[:-1])


@pytest.fixture(scope="module")
def rounded_engines(tiny_model_dir):
    """An engine with fp8_lm_head, and one without on the rounded model's plain weights (fp8_lm_head.rounded_copy)."""
    opts = dict(num_slots=4, max_len=256, num_retained=2, fused_kernels=True)
    engine = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(**opts, fp8_lm_head=True))
    copy = Engine(fp8_lm_head.rounded_copy(engine.model), engine.tokenizer, EngineOptions(**opts))
    return engine, copy


def test_an_engine_with_an_fp8_lm_head_streams_its_bytes_and_decodes_the_rounded_models_tokens(rounded_engines,
                                                                                              monkeypatch):
    engine, copy = rounded_engines
    weights = {}
    for name in ("partial_products", "linear_argmax", "gate_up_silu"):
        real = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda x, w, *a, real=real, name=name, **k:
                            weights.setdefault(name, set()).add(w.dtype) or real(x, w, *a, **k))
    clips = [speech(s, seed=70 + i) for i, s in enumerate([0.6, 1.4, 0.9])]
    reqs = [DecodeRequest(audio=c, max_new_tokens=b) for c, b in zip(clips, [4, 7, 5])]
    got = [r.token_ids for r in engine.transcribe(reqs)]
    # the lm_head read FP8 bytes, the layers' products their bf16 (here float32) weights
    assert weights["linear_argmax"] == {fp8_lm_head.E4M3}
    assert fp8_lm_head.E4M3 not in weights["partial_products"] | weights["gate_up_silu"]
    weights.clear()
    assert got == [r.token_ids for r in copy.transcribe(reqs)]
    assert fp8_lm_head.E4M3 not in set().union(*weights.values())
    assert got[1] == engine.transcribe([reqs[1]])[0].token_ids  # a row alone decodes as in the batch
