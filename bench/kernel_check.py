"""GPU check of the fused decoder kernels at real shapes: each kernel against the PyTorch reference in bf16, then the
decode step on both paths (graph replay time, kernels per step) and the encoder graphs against eager.

`python -m qasr.bench.kernel_check [0.6B|1.7B]` on a CUDA machine; prints one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from qasr.model import kernels
from qasr.model.modeling import RMSNorm, rotate_half
from qasr.model.testmodel import make_test_model
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest
from qasr.engine.runner import ModelRunner

from .synthetic import speech_like


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
    return out


def step_ms(runner: ModelRunner, B: int, context: int, runs: int = 50) -> float:
    runner.budgets[:B] = 1 << 30
    samples = []
    for _ in range(runs + 3):
        runner.positions[:B] = context
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.graphs[B].replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    runner.positions.fill_(-1)
    return statistics.median(samples[3:])


def kernels_per_step(runner: ModelRunner, B: int, context: int) -> int:
    runner.positions[:B] = context
    runner._step(B)
    torch.cuda.synchronize()
    runner.positions[:B] = context
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner._step(B)
        torch.cuda.synchronize()
    runner.positions.fill_(-1)
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


def main(argv=None) -> None:
    size = (argv or sys.argv[1:] or ["0.6B"])[0]
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        d = make_test_model(f"{tmp}/m", size=size, dtype="bfloat16")
        engine = Engine.from_pretrained(str(d), device=device, dtype="bfloat16",
                                        options=EngineOptions(num_slots=64, max_len=320, num_retained=0,
                                                              cuda_graphs=False))
    model = engine.model
    res = {"size": size, "kernels_bf16_vs_pytorch": kernel_cases(model.cfg.text, device)}
    steps = {}
    for fused in (False, True):
        runner = ModelRunner(model, num_slots=64, max_len=320, fused_kernels=fused)
        name = "fused" if fused else "pytorch"
        steps[name] = {B: step_ms(runner, B, 200) for B in (1, 8, 64)}
        steps[name + "_kernels_per_step_B1"] = kernels_per_step(runner, 1, 200)
        if fused:  # encoder graphs against the eager encoder, same windows
            enc = model.encoder
            torch.manual_seed(1)
            windows = torch.randn(3, enc.cfg.window_tokens, enc.cfg.d_model, device=device, dtype=model.dtype)
            lengths = torch.tensor([enc.cfg.window_tokens, 40, 7], device=device)
            eager = enc.encode_windows(windows, lengths)
            graphed = runner.encode_windows(windows, lengths)
            res["encoder_graph_vs_eager"] = compare(
                torch.cat([graphed[i, :n] for i, n in enumerate(lengths.tolist())]),
                torch.cat([eager[i, :n] for i, n in enumerate(lengths.tolist())]))
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
                res[f"encoder_ms_{W}_windows"] = times
        del runner
        torch.cuda.empty_cache()
    res["decode_step_ms_context_200"] = steps
    print(json.dumps(res, indent=2), flush=True)


if __name__ == "__main__":
    main()
