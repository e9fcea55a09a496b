"""Where the GPU's time goes, by kernel, on a random real-shape checkpoint (#15, #16): the decode step's graph replay
at several buckets, and a live-like admission (partials of streams that kept their earlier chunks, and finals) with the
operator and input shapes behind each kernel; then side-by-side timings of kernel variants still being decided, and
the int8 KV cache (EngineOptions.kv_cache_int8) against bf16: step time, kernels, token agreement.

    python -m qasr.bench.profile_decode [0.6B|1.7B] [--sections step,admission,variants]    # on CUDA, ~2 min

Prints one JSON object per line, a section each (a time limit leaves the sections that finished), and the admission's
operator table as text.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import tempfile

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest, Priority
from qasr.engine.runner import capture_graph, capture_stream
from qasr.model import kernels
from qasr.model.testmodel import make_test_model

from .kernel_check import size_and_sections
from .synthetic import speech_like

SECTIONS = ("step", "admission", "variants", "int8")
STEP_BUCKETS = (1, 32, 128, 256)
CONTEXT = 200  # decode rows' positions: a ~10 s segment's prompt and answer


def kernel_times(prof, replays: int, top: int = 14) -> dict:
    """Per replay: the GPU time of each kernel name (us), the busiest first, and the total."""
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            t = totals.setdefault(e.name[:80], [0, 0.0])
            t[0] += 1
            t[1] += e.time_range.elapsed_us()
    rows = sorted(totals.items(), key=lambda item: -item[1][1])
    return {"total_us": sum(t for _, (_, t) in rows) / replays, "launches": sum(n for _, (n, _) in rows) / replays,
            "kernels": {name: [round(n / replays, 1), round(t / replays, 1)] for name, (n, t) in rows[:top]}}


def gpu_ms(fn, runs: int = 30) -> float:
    """Median GPU time of fn() (CUDA events), after three warm-up calls."""
    samples = []
    for i in range(runs + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 3:
            samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def fill_cache(cache) -> None:
    """Random keys and values (an int8 cache: random integers and scales)."""
    gen = torch.Generator(device=cache.k[0].device).manual_seed(0)
    for layer in (*cache.k, *cache.v):
        if layer.dtype == torch.int8:
            layer.random_(-127, 128, generator=gen)
        else:
            layer.normal_(generator=gen)
    for scale in (t for pair in cache.scales or () for t in pair):
        scale.uniform_(0.001, 0.05, generator=gen)


def step_ms(engine: Engine, runs: int = 30) -> dict:
    """Each bucket's graphed decode step, every row live at CONTEXT: median GPU ms a replay."""
    runner = engine.runner
    runner.budgets.fill_(1 << 30)

    def replay(B):
        runner.positions[:B] = CONTEXT
        runner.graphs[B].replay()

    out = {B: round(gpu_ms(lambda: replay(B), runs), 4) for B in STEP_BUCKETS}
    runner.positions.fill_(-1)
    return out


def int8_section(bf16: Engine, int8: Engine, requests: int = 32, tokens: int = 40) -> dict:
    """The int8 KV cache against the model's dtype: the step's replay time at the buckets (the same weights), its
    kernels, and the tokens of the same forced-length requests (random weights: how often int8's rounding of K and V
    changes the argmax)."""
    fill_cache(int8.runner.cache)
    out = {"step_ms": {"bf16": step_ms(bf16), "int8": step_ms(int8)}, "int8_step_kernels_us": step_section(int8)}
    reqs = [DecodeRequest(audio=speech_like(3 + i % 8, seed=500 + i), max_new_tokens=tokens) for i in range(requests)]
    a, b = ([r.token_ids for r in engine.transcribe(reqs)] for engine in (bf16, int8))
    out["first_tokens_identical"] = sum(x[0] == y[0] for x, y in zip(a, b)) / requests
    out["tokens_identical"] = sum(u == v for x, y in zip(a, b) for u, v in zip(x, y)) / (requests * tokens)
    out["requests_identical"] = sum(x == y for x, y in zip(a, b)) / requests
    return out


def step_section(engine: Engine, replays: int = 20) -> dict:
    """Each bucket's graphed decode step, every row live at CONTEXT: GPU time per kernel per step."""
    runner = engine.runner
    fill_cache(runner.cache)
    runner.budgets.fill_(1 << 30)
    out = {}
    for B in STEP_BUCKETS:
        runner.positions[:B] = CONTEXT
        runner.graphs[B].replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                runner.positions[:B] = CONTEXT  # the same work every replay
                runner.graphs[B].replay()
            torch.cuda.synchronize()
        out[B] = kernel_times(prof, replays)
        out[B]["kernels"] = {k: v for k, v in out[B]["kernels"].items() if not k.startswith(("Memcpy", "Memset",
                                                                                             "void at::native::vect"))}
    runner.positions.fill_(-1)
    return out


def live_like_requests(streams: list, round_: int, finals: int = 6) -> list[DecodeRequest]:
    """One admission's worth at 1,000 streams: a partial of each of 20 streams, one second longer than in the round
    before (so each kept its earlier chunks; after 6 s a stream starts again), and `finals` finals of 3-6 s segments.
    streams: each stream's audio (7.5 s). One token each: the admission's work only."""
    reqs = []
    for s, clip in enumerate(streams):
        seconds = 1 + (s + round_) % 6
        reqs.append(DecodeRequest(audio=clip[: int((seconds + 0.3) * 16000)], priority=Priority.PARTIAL,
                                  stream_id=f"s{s}", max_new_tokens=1))
    for f in range(finals):
        reqs.append(DecodeRequest(audio=speech_like(3 + f % 4, seed=100 + f + round_), max_new_tokens=1))
    return reqs


def admission_section(engine: Engine) -> dict:
    """A live-like admission's device work, profiled with the operators that launched it (CPU and CUDA)."""
    streams = [speech_like(7.5, seed=s) for s in range(20)]
    for r in range(3):  # rounds 0-2: streams keep chunks and windows, shapes warm
        engine.transcribe(live_like_requests(streams, r))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        engine.transcribe(live_like_requests(streams, 3))
        torch.cuda.synchronize()
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="device_time_total", row_limit=30,
                                                            max_name_column_width=48, max_shapes_column_width=70))
    return kernel_times(prof, 1, top=25)


def conv_front_variants(engine: Engine, chunks: int) -> dict:
    """The encoder's first convolution (1 input channel, so a reduction of 9: cuBLAS/cuDNN pick an unaligned kernel)
    as it is and with its input padded with zero channels to 8 (the same sums, plus zeros), and channels-last; each
    timed with its GELU, against the first's output."""
    enc = engine.model.encoder
    conv = enc.conv2d1
    x = torch.randn(chunks, 1, 128, 100, device=conv.weight.device, dtype=conv.weight.dtype)
    w8 = F.pad(conv.weight, (0, 0, 0, 0, 0, 7))  # [C, 8, 3, 3]
    base = lambda: F.gelu(conv(x))  # noqa: E731
    pad8 = lambda: F.gelu(F.conv2d(F.pad(x, (0, 0, 0, 0, 0, 7)), w8, conv.bias, 2, 1))  # noqa: E731
    x_cl = x.to(memory_format=torch.channels_last)
    w_cl = conv.weight.to(memory_format=torch.channels_last)
    last = lambda: F.gelu(F.conv2d(x_cl, w_cl, conv.bias, 2, 1))  # noqa: E731
    ref = base().float()
    out = {}
    for name, fn in (("as_is", base), ("pad8", pad8), ("channels_last", last)):
        got = fn().float()
        out[name] = {"ms": round(gpu_ms(fn), 4), "max_abs": float((got - ref).abs().max()),
                     "identical": float((got == ref).float().mean())}
    whole = lambda: enc.embed_chunks(x[:, 0])  # noqa: E731
    out["embed_chunks_ms"] = round(gpu_ms(whole), 4)
    return out


def attention_variants(engine: Engine, layers: int = 28) -> dict:
    """The decode attention kernel's tile and pipelining choices at the step buckets, `layers` launches captured in a
    graph as in a step (timed alone, one launch is mostly Python's launch cost): GPU us a launch, and agreement with
    the kernel as launched (BLOCK_N 64, 4 warps)."""
    runner = engine.runner
    cfg = engine.model.cfg.text
    H, hd = cfg.num_attention_heads, cfg.head_dim
    k_cache, v_cache = runner.cache.k[0], runner.cache.v[0]
    kvh = k_cache.shape[1]
    sc, sh, sl, _ = k_cache.stride()
    out = {}
    for B in STEP_BUCKETS:
        q = torch.randn(B, H, hd, device=runner.device, dtype=k_cache.dtype)
        positions = torch.full((B,), CONTEXT, device=runner.device)
        ref = kernels.decode_attention(q, k_cache, v_cache, positions)
        for block_n, warps, stages in ((64, 4, None), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4),
                                       (64, 8, 3)):
            o = torch.empty_like(ref)
            extra = {} if stages is None else {"num_stages": stages}

            def launch():
                kernels._decode_attention_kernel[(B, kvh)](
                    q, k_cache, v_cache, o, positions, sc, sh, sl, 1.0 / math.sqrt(hd), H=H, G=H // kvh,
                    G_BLOCK=max(16, 1 << (H // kvh - 1).bit_length()), HD=hd, BLOCK_N=block_n, num_warps=warps,
                    PDL=False, **extra)

            with capture_stream() as stream:
                graph, _ = capture_graph(lambda: [launch() for _ in range(layers)], stream, None, warmups=1)
            ms = gpu_ms(graph.replay)
            out[f"B{B} n{block_n} w{warps} s{stages}"] = {"us": round(ms * 1e3 / layers, 2),
                                                          "max_abs": float((o.float() - ref.float()).abs().max())}
    return out


def main(argv=None) -> None:
    size, sections = size_and_sections("python -m qasr.bench.profile_decode", SECTIONS, argv)
    with tempfile.TemporaryDirectory() as tmp:
        d = make_test_model(f"{tmp}/m", size=size, dtype="bfloat16")
        # the stream bench's server: 256 decode rows, 640 positions, streams' prefixes retained
        opts = EngineOptions(num_slots=256, max_len=640, num_retained=64, ignore_eos=True, repetition_window=0)
        engine = Engine.from_pretrained(str(d), device="cuda", dtype="bfloat16", options=opts)
        int8 = (Engine.from_pretrained(str(d), device="cuda", dtype="bfloat16",
                                       options=dataclasses.replace(opts, kv_cache_int8=True))
                if "int8" in sections else None)

    def emit(section: str, value) -> None:
        print(json.dumps({section: value}), flush=True)

    emit("size", size)
    if "step" in sections:
        emit("decode_step_kernels_us", step_section(engine))
    if "admission" in sections:
        emit("admission_kernels_us", admission_section(engine))
    if "variants" in sections:
        emit("conv_front_variants", {n: conv_front_variants(engine, n) for n in (8, 40)})
        emit("decode_attention_variants", attention_variants(engine))
    if int8 is not None:
        emit("kv_cache_int8", int8_section(engine, int8))


if __name__ == "__main__":
    main()
