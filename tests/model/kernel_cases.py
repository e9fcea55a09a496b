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

from qasr.model import kernels
from qasr.model.modeling import FusedLayerOps, PlainLayerOps, RMSNorm, rotate_half
from qasr.engine import runner as runner_module
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest, Priority

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/model/test_kernels.py"

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


def rope_tables(length: int, hd: int):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.arange(length)[:, None].float() * inv
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def test_qk_norm_rope_store_matches_reference_and_writes_only_its_positions():
    H, KVH, hd, S, L, N = 4, 2, 16, 6, 48, 7
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


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 2)])
def test_decode_attention_reads_each_rows_live_keys(heads, kv_heads):
    hd, S, L = 16, 7, 80
    k_cache, v_cache = torch.randn(S, kv_heads, L, hd), torch.randn(S, kv_heads, L, hd)
    positions = torch.tensor([0, 5, -1, 70, 63, 64])  # around the 64-key blocks; -1 is a padding row
    B = len(positions)
    q = torch.randn(B, heads, hd)
    out = kernels.decode_attention(q, k_cache, v_cache, positions)
    group = heads // kv_heads
    for b in range(B):
        n = max(int(positions[b]), 0) + 1
        k = k_cache[b, :, :n].repeat_interleave(group, 0)
        v = v_cache[b, :, :n].repeat_interleave(group, 0)
        expected = F.scaled_dot_product_attention(q[b][:, None], k, v)[:, 0].reshape(-1)
        assert torch.allclose(out[b], expected, atol=TOL, rtol=TOL), b
    # keys past a row's position must not matter
    k_cache[:, :, 71:] = 1e4
    assert torch.equal(kernels.decode_attention(q, k_cache, v_cache, positions), out)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
def test_prefill_attention_is_causal_over_each_slots_cache(heads, kv_heads):
    hd, S, L = 16, 6, 96
    k_cache, v_cache = torch.randn(S, kv_heads, L, hd), torch.randn(S, kv_heads, L, hd)
    slots = torch.tensor([3, 0, 5])
    starts = torch.tensor([0, 40, 7])  # sequence 1 continues after 40 cached positions (a reused prefix)
    lengths = torch.tensor([20, 37, 1])
    B, T = 3, 37  # crosses the 16-token tiles and a 64-key block
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


def test_prefill_padded_to_buckets_gives_the_same_tokens(tiny_model_dir, engines):
    _, plain = engines
    padded = Engine.from_pretrained(str(tiny_model_dir), device="cpu",
                                    options=EngineOptions(num_slots=4, max_len=256, num_retained=2, fused_kernels=True))
    padded.runner.build_prefill_buckets(capture=False)  # the graphed path's padding, run eagerly
    assert padded.runner._prefill_bucket(3, 100) is padded.runner.prefill_buckets[(4, 128)]
    clips = [speech(s, seed=20 + i) for i, s in enumerate([0.7, 2.5, 1.1])]
    reqs = [DecodeRequest(audio=c, max_new_tokens=8) for c in clips]
    assert [r.token_ids for r in padded.transcribe(reqs)] == [r.token_ids for r in plain.transcribe(reqs)]
    assert [padded.transcribe([r])[0].token_ids for r in reqs] == [r.token_ids for r in plain.transcribe(reqs)]


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
    every decode, encoder and prefill bucket is warmed up and recorded, each group into one pool of its own."""

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
    monkeypatch.setattr(runner_module, "ENCODER_BUCKETS", (1, 2, 4))  # fewer buckets: the interpreter is slow
    monkeypatch.setattr(runner_module, "PREFILL_BATCH_BUCKETS", (1, 2))
    model = Engine.from_pretrained(str(tiny_model_dir), device="cpu", options=EngineOptions(
        num_slots=4, max_len=64, num_retained=0, fused_kernels=True)).model
    runner = runner_module.ModelRunner(model, num_slots=4, max_len=64, cuda_graphs=True, fused_kernels=True)

    assert list(runner.graphs) == [4, 2, 1]
    assert list(runner.encoder_graphs) == list(runner_module.ENCODER_BUCKETS)
    assert sorted(runner.prefill_buckets) == [(b, 64) for b in runner_module.PREFILL_BATCH_BUCKETS]
    assert all(bucket.graph is not None and bucket.first is not None for bucket in runner.prefill_buckets.values())
    groups = [3, len(runner_module.ENCODER_BUCKETS), len(runner_module.PREFILL_BATCH_BUCKETS)]
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
