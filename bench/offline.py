"""`qasr-bench offline`: latency, throughput, decode-step time and kernels per step, energy and row correctness, beside
the official backend.

Real 0.6B / 1.7B shapes with random weights (a generated checkpoint), decoding forced to a fixed token count, the
official qwen-asr transformers backend timed in the same run on the same checkpoint. Prints a table and writes JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from qasr.engine import gpu_timeline
from qasr.engine.gc_pauses import GcPauses, freeze_loaded_heap, thaw
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.options import NUMBER_FORMATS, OFFLINE_DECODE_RUN_AHEAD, OFFLINE_DECODE_STEPS_AHEAD, number_formats
from qasr.engine.request import DecodeRequest
from qasr.model import fp8_lm_head, gemv

from .synthetic import speech_like


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device) -> float:
    """Measured device copy bandwidth in bytes/s (bytes read + written)."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 20
    del x, y
    return 2 * (1 << 30) / seconds


class Energy:
    """GPU energy from NVML's total-energy counter (mJ), or None where NVML is missing."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:
            self._nvml = None

    def joules(self) -> float | None:
        if self._nvml is None:
            return None
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3


def joules_per_audio_hour(joules_before: float, joules_after: float, audio_seconds: float) -> float:
    """GPU energy of a run, scaled to one hour of audio transcribed."""
    if audio_seconds <= 0 or joules_after < joules_before:
        raise ValueError(f"need audio > 0 s and a counter that did not run backwards, got {audio_seconds} s, "
                         f"{joules_before} -> {joules_after} J")
    return (joules_after - joules_before) / audio_seconds * 3600


def count_kernels(events, replays: int) -> float:
    """Kernels per replay from profiler events (key_averages() rows: .key, .count, .device_type): the CUDA events
    that are kernels (copies and memsets are not), divided by the replays profiled."""
    total = sum(e.count for e in events if e.device_type.name == "CUDA" and not e.key.startswith(("Memcpy", "Memset")))
    return total / replays


def kernels_per_step(runner, B: int, context: int, replays: int = 3) -> float:
    """Kernels one decode step of bucket B launches: over `replays` graph replays (CUPTI sees a graph's kernel
    nodes), or eager steps where the bucket has no graph. Every row live at position `context`."""
    runner.budgets[:B] = 1 << 30
    runner.positions[:B] = context  # rows stay live (a step only moves them on by one)
    step = runner.graphs[B].replay if B in runner.graphs else lambda: runner._step(B)
    prof = profiled(step, replays)
    runner.positions.fill_(-1)
    return count_kernels(prof.key_averages(), replays)


def profiled(step, replays: int):
    """The CUDA profiler over `replays` calls of step() (after one outside it: first-use costs) -> the profile."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            step()
        torch.cuda.synchronize()
    return prof


def requests(clips: list[np.ndarray], tokens: int) -> list[DecodeRequest]:
    return [DecodeRequest(audio=c, max_new_tokens=tokens) for c in clips]


def engine_overrides(args) -> dict:
    """The engine options the command line set (None: the engine's default; steps ahead and run-ahead: offline's)."""
    names = ("decode_steps_ahead", "admission_interval_ms", "decode_run_ahead", *NUMBER_FORMATS)
    overrides = {"decode_steps_ahead": OFFLINE_DECODE_STEPS_AHEAD, "decode_run_ahead": OFFLINE_DECODE_RUN_AHEAD}
    return overrides | {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def offline_options(slots: int, max_len: int, prefill_tokens: int, args=None) -> EngineOptions:
    """The offline bench's engine: decoding forced to the token count, no prefixes kept, offline's steps ahead and
    what the command line set (engine_overrides)."""
    return EngineOptions(num_slots=slots, max_len=max_len, num_retained=0, ignore_eos=True, repetition_window=0,
                         max_prefill_tokens=prefill_tokens, **engine_overrides(args))


def bench_qasr(model_dir: Path, args, device: torch.device, out: dict) -> None:
    clip = speech_like(args.clip_seconds, seed=1)
    opts = offline_options(args.slots, args.max_len, args.prefill_tokens, args)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(str(model_dir), device=device, dtype=args.dtype, options=opts)
    out["qasr_load_and_capture_s"] = time.perf_counter() - t0
    if args.freeze_heap:  # as qasr-transcribe and the engine process do (gc_pauses.py)
        out["qasr_frozen_objects"] = freeze_loaded_heap()
    out["engine_options"] = {"decode_steps_ahead": opts.decode_steps_ahead,
                             "admission_interval_ms": opts.admission_interval_ms, "decode_run_ahead": engine.run_ahead,
                             **number_formats(opts)}

    # batch-1 latency, features included: audio array in -> text out
    for _ in range(3):
        engine.transcribe(requests([clip], args.tokens))
    out["qasr_bs1_latency_ms"], out["qasr_bs1_breakdown_ms"] = batch1_latency(engine, clip, args.tokens,
                                                                              args.latency_runs, device)
    out["engine_step_ms"] = engine_step_ms(engine, clip, args.tokens)

    # throughput at the engine's concurrency (all clips queued at once; continuous batching)
    clips = [speech_like(args.clip_seconds, seed=100 + i) for i in range(args.num_clips)]
    engine.transcribe(requests(clips[: args.slots], args.tokens))  # warm the prefill/encoder shapes
    out.update(throughput_run(engine, clips, args.tokens, args.clip_seconds))
    if args.timeline:
        out["qasr_throughput_timeline"] = throughput_timeline(engine, clips, args.tokens)

    # decode step per bucket against the bandwidth floor
    out["gemv_rows"] = getattr(engine.runner.layer_ops, "gemv_rows", 0)  # 0: every product on cuBLAS
    out["gemv_configs"] = gemv.chosen_configs()
    if device.type == "cuda":
        out["decode_step_ms"] = step_times(engine, args)
        out["decode_kernels_per_step"] = {B: kernels_per_step(engine.runner, B, args.context)
                                          for B in engine.runner.buckets if B in (1, 8, 32, 64, 256)}
        bw = copy_bandwidth(device)
        out["copy_bandwidth_TBps"] = bw / 1e12
        out["decode_floor_ms"] = step_floors(engine, args, bw)
    out["correctness"] = correctness(engine, args)
    if args.freeze_heap:
        thaw()  # the engine's objects back to the collector: freed once it goes
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()


def batch1_latency(engine: Engine, clip: np.ndarray, tokens: int, runs: int,
                   device: torch.device) -> tuple[float, dict[str, float]]:
    """The clip alone, `runs` times, audio array in to text out -> (median ms, the median of each piece of the
    engine's breakdown: queue, encode, prefill, decode)."""
    latency, parts = [], []
    for _ in range(runs):
        _sync(device)
        t = time.perf_counter()
        (r,) = engine.transcribe(requests([clip], tokens))
        latency.append((time.perf_counter() - t) * 1e3)
        parts.append(r.timings)
        assert len(r.token_ids) == tokens, r.finish_reason
    return statistics.median(latency), {k: statistics.median(p[k] for p in parts) for k in parts[0]}


ENGINE_STEP_ROWS = (1, 16, 128)


def engine_step_ms(engine: Engine, clip: np.ndarray, tokens: int, runs: int = 3) -> dict[str, dict[int, float]]:
    """A decode step as the engine loop makes it (launch, read, the host's work on the tokens): the median over rows
    and runs of a request's decode time / its steps, `rows` copies of the clip admitted together, each step read
    before the next is launched and with run-ahead, in this one process (so both run the same kernels). Against the
    graph's own replay time (decode_step_ms) the difference is what the loop adds. The rows start after their
    prefill, as the host's wait starts them: a lone admission's rows otherwise start on a device wait
    (Engine.lone_admission_waits_on_device), and their decode_ms would hold the prefill's last milliseconds."""
    out = {}
    ahead, on_device = engine.run_ahead, engine.lone_admission_waits_on_device
    engine.lone_admission_waits_on_device = False
    try:
        for mode, run_ahead in (("read_each", False), ("run_ahead", True)):
            engine.run_ahead = run_ahead
            out[mode] = {}
            for rows in (r for r in ENGINE_STEP_ROWS if r <= engine.options.num_slots):
                per_step = []
                for _ in range(runs):
                    results = engine.transcribe(requests([clip] * rows, tokens))
                    per_step += [r.timings["decode_ms"] / (tokens - 1) for r in results]
                out[mode][rows] = statistics.median(per_step)
    finally:
        engine.run_ahead, engine.lone_admission_waits_on_device = ahead, on_device
    return out


def throughput_run(engine: Engine, clips: list[np.ndarray], tokens: int, clip_seconds: float) -> dict:
    """All `clips` queued at once and decoded to `tokens` each -> audio-seconds per second, where the engine thread's
    time went (admitting, launching and waiting for steps, reading their tokens), the decode batches and the energy."""
    device = engine.runner.device
    out: dict = {}
    energy = Energy()
    _sync(device)
    e0, t = energy.joules(), time.perf_counter()
    counters0, steps0 = dict(engine.counters), engine.steps
    engine.recent_batch_sizes = collections.deque()  # every step of this run, for the batch-size histogram
    seconds0 = dict(engine.seconds)
    pauses = GcPauses.watch()  # a full collection holds the engine thread (and so the GPU's next work) throughout
    try:
        results = engine.transcribe(requests(clips, tokens))
        _sync(device)
    finally:
        pauses.stop()
    elapsed = time.perf_counter() - t
    out["qasr_throughput_gc"] = {"collections": pauses.count, "ms": [round(x * 1e3, 1) for x in pauses.seconds],
                                 "longest_ms": round(pauses.longest_pause * 1e3, 1)}
    out["qasr_throughput_engine_thread"] = {k: (engine.seconds[k] - seconds0[k]) / elapsed for k in seconds0}
    e1 = energy.joules()
    audio_s = len(clips) * clip_seconds
    out["qasr_throughput_audio_s_per_s"] = audio_s / elapsed
    out["qasr_throughput_tokens_per_s"] = sum(len(r.token_ids) for r in results) / elapsed
    out["qasr_throughput_clips"] = len(clips)
    # admissions, and those with nothing decoding (the GPU idle through their host work)
    out["qasr_throughput_admissions"] = {key: engine.counters[key] - counters0[key]
                                         for key in ("admissions", "admissions_alone")}
    if e0 is not None:
        out["qasr_energy_j_per_audio_hour"] = joules_per_audio_hour(e0, e1, audio_s)
        out["qasr_avg_power_w"] = (e1 - e0) / elapsed
    steps = engine.steps - steps0
    rows = engine.counters["decode_rows"] - counters0["decode_rows"]
    out["qasr_mean_decode_batch"] = rows / steps if steps else 0.0
    sizes = np.array(engine.recent_batch_sizes)
    out["qasr_decode_batch_percentiles"] = ({p: float(np.percentile(sizes, p)) for p in (5, 25, 50, 75, 95)}
                                             if sizes.size else {})
    engine.recent_batch_sizes = collections.deque(maxlen=64)
    return out


def throughput_timeline(engine: Engine, clips: list[np.ndarray], tokens: int) -> dict:
    """The throughput run again under torch's profiler (not the timed one: the profiler slows the host) -> what kept
    the GPU busy, per CUDA stream (engine/gpu_timeline.py's summary): whether the run waited on the GPU's work or
    on the engine thread's. On the CPU (tests) the same summary of its operators, per thread."""
    device = engine.runner.device
    with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        engine.transcribe(requests(clips, tokens))
        _sync(device)
        window_s = time.perf_counter() - t
    return gpu_timeline.summarize(gpu_timeline.kernels_of(prof, device.type), window_s)


def step_times(engine: Engine, args) -> dict[int, float]:
    """Median replay time of each bucket's graph with every row live at a context of ~args.context tokens."""
    engine.drain()  # run-ahead leaves a launch queued after a call's last rows: runner.decode needs none in flight
    runner = engine.runner
    times = {}
    for B in runner.buckets:
        runner.positions[:B] = args.context  # live rows, mid-sequence; budgets high so nothing finishes
        runner.budgets[:B] = 1 << 30
        runner.counts[:B] = 0
        for _ in range(3):
            runner.positions[:B] = args.context
            runner.decode(B)
        samples = []
        for _ in range(args.step_runs):
            runner.positions[:B] = args.context
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if B in runner.graphs:
                runner.graphs[B].replay()
            else:
                runner._step(B)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        times[B] = statistics.median(samples)
    runner.positions.fill_(-1)
    return times


def step_floors(engine: Engine, args, bandwidth: float) -> dict[int, float]:
    """(decoder weights + lm_head + live KV bytes) / measured bandwidth, per bucket, in ms."""
    dec = engine.model.decoder
    elem = dec.lm_head.weight.element_size()
    weights = sum(p.numel() for n, p in dec.named_parameters() if not n.startswith("embed_tokens")) * elem
    if dec.lm_head.weight is dec.embed_tokens.weight:  # tied: named_parameters lists it once, as embed_tokens
        weights += dec.lm_head.weight.numel() * elem
    c = dec.cfg
    vector = c.head_dim + 4 if engine.options.kv_int8 else c.head_dim * elem  # int8 values and a float32 scale
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * vector
    # with fp8_lm_head the small steps' lm_head streams one byte a weight (and a float32 scale a row)
    fp8_rows = getattr(engine.runner.layer_ops, "gemv_rows", 0) if engine.options.fp8_lm_head else 0
    saved = dec.lm_head.weight.numel() * (elem - 1) - dec.lm_head.weight.shape[0] * 4
    return {B: (weights - (saved if B <= fp8_rows else 0) + B * args.context * kv_per_token) / bandwidth * 1e3
            for B in engine.runner.buckets}


def correctness(engine: Engine, args) -> dict:
    """Row correctness: identical rows, batch independence under joining/leaving, agreement with batch-1."""
    rng = np.random.default_rng(7)
    res = {}
    # identical inputs in one batch -> identical rows, at every bucket size
    clip = speech_like(args.clip_seconds, seed=3)
    bad = []
    for B in engine.runner.buckets:
        rows = engine.transcribe(requests([clip] * B, args.tokens))
        if any(r.token_ids != rows[0].token_ids for r in rows):
            bad.append(B)
    res["identical_rows_failed_buckets"] = bad
    # mixed lengths, queued together so they join and leave mid-flight, vs each alone
    n = args.independence_requests
    lengths = rng.uniform(0.5, 20.0, n)
    budgets = rng.integers(8, 48, n)
    clips = [speech_like(float(s), seed=1000 + i) for i, s in enumerate(lengths)]
    reqs = [DecodeRequest(audio=c, max_new_tokens=int(b)) for c, b in zip(clips, budgets)]
    batched = engine.transcribe(reqs)
    alone = [engine.transcribe([r])[0] for r in reqs]
    same = sum(a.token_ids == b.token_ids for a, b in zip(batched, alone))
    tok_total = sum(len(a.token_ids) for a in alone)
    tok_same = sum(sum(x == y for x, y in zip(a.token_ids, b.token_ids)) for a, b in zip(batched, alone))
    res["batch_independence_exact_match"] = f"{same}/{n}"
    res["batch_independence_token_agreement"] = tok_same / max(1, tok_total)
    # agreement with the eager batch-1 path: a fresh engine on the same model in plain PyTorch (no graphs, no fused
    # kernels), the reference the fast path must reproduce; with fp8_lm_head, on the rounded model's plain weights
    reference = fp8_lm_head.rounded_copy(engine.model) if engine.options.fp8_lm_head else engine.model
    eager = Engine(reference, engine.tokenizer, EngineOptions(num_slots=1, max_len=engine.options.max_len,
                                                               num_retained=0, ignore_eos=True, repetition_window=0,
                                                               cuda_graphs=False, fused_kernels=False,
                                                               kv_int8=engine.options.kv_int8))
    k = min(args.eager_requests, n)
    eager_out = [eager.transcribe([r])[0] for r in reqs[:k]]
    agree = sum(sum(x == y for x, y in zip(a.token_ids, b.token_ids)) for a, b in zip(eager_out, batched[:k]))
    total = sum(len(a.token_ids) for a in eager_out)
    res["eager_bs1_token_agreement"] = agree / max(1, total)
    res["eager_bs1_exact_match"] = f"{sum(a.token_ids == b.token_ids for a, b in zip(eager_out, batched[:k]))}/{k}"
    del eager, reference
    if any(number_formats(engine.options).values()):  # what they change: the same requests batched on a bf16
        # cache with bf16 products
        plain = Engine(engine.model, engine.tokenizer, dataclasses.replace(
            engine.options, cuda_graphs=False, **dict.fromkeys(NUMBER_FORMATS, False)))
        reference = plain.transcribe(reqs)
        agree = sum(sum(x == y for x, y in zip(a.token_ids, b.token_ids)) for a, b in zip(reference, batched))
        res["bf16_reference_token_agreement"] = agree / max(1, sum(len(a.token_ids) for a in reference))
        res["bf16_reference_exact_match"] = f"{sum(a.token_ids == b.token_ids for a, b in zip(reference, batched))}/{n}"
        del plain
    return res


def bench_official(model_dir: Path, args, device: torch.device, out: dict) -> None:
    """The official qwen-asr 0.0.6 transformers backend, same checkpoint, same clip, same forced token count."""
    import importlib.util
    import types

    import transformers  # noqa: F401  (first: it probes optional packages before the stand-ins go in)

    for name in ("librosa", "nagisa", "soynlp", "qwen_omni_utils", "sox", "gradio", "flask", "pytz", "soundfile"):
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = types.ModuleType(name)
    from qwen_asr.inference.qwen3_asr import Qwen3ASRModel

    dtype = torch.bfloat16 if args.dtype in ("auto", "bfloat16") else torch.float32
    wrapper = Qwen3ASRModel.from_pretrained(str(model_dir), dtype=dtype, device_map=str(device),
                                            max_inference_batch_size=args.official_batch, max_new_tokens=args.tokens)
    model, proc = wrapper.model, wrapper.processor

    def run(clips):
        texts = [wrapper._build_text_prompt(context="", force_language=None) for _ in clips]
        inp = proc(text=texts, audio=clips, return_tensors="pt", padding=True).to(model.device).to(model.dtype)
        seqs = model.generate(**inp, max_new_tokens=args.tokens, min_new_tokens=args.tokens).sequences
        _sync(device)
        return seqs

    clip = speech_like(args.clip_seconds, seed=1)
    for _ in range(2):
        run([clip])
    lat = []
    for _ in range(max(3, args.latency_runs // 4)):
        t = time.perf_counter()
        run([clip])
        lat.append((time.perf_counter() - t) * 1e3)
    out["official_bs1_latency_ms"] = statistics.median(lat)
    clips = [speech_like(args.clip_seconds, seed=100 + i) for i in range(args.official_clips)]
    run(clips[: args.official_batch])
    t = time.perf_counter()
    for i in range(0, len(clips), args.official_batch):
        run(clips[i : i + args.official_batch])
    elapsed = time.perf_counter() - t
    out["official_throughput_audio_s_per_s"] = len(clips) * args.clip_seconds / elapsed
    out["official_batch"] = args.official_batch
    del wrapper, model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args) -> dict:
    from qasr.model.checkpoint import resolve_device
    from qasr.model.testmodel import make_test_model

    device = resolve_device(args.device)
    out: dict = {"size": args.size, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "clip_seconds": args.clip_seconds, "tokens": args.tokens,
                 "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir = Path(args.model)
        else:
            t = time.perf_counter()
            model_dir = make_test_model(Path(tmp) / "model", size=args.size, dtype="bfloat16")
            out["checkpoint_write_s"] = time.perf_counter() - t
        if args.official:
            try:
                bench_official(model_dir, args, device, out)
            except Exception as e:  # still measure qasr; the report shows the baseline is missing and why
                out["official_error"] = f"{type(e).__name__}: {e}"
        bench_qasr(model_dir, args, device, out)
    if "official_bs1_latency_ms" in out:
        out["speedup_bs1_latency"] = out["official_bs1_latency_ms"] / out["qasr_bs1_latency_ms"]
        out["speedup_throughput"] = out["qasr_throughput_audio_s_per_s"] / out["official_throughput_audio_s_per_s"]
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    """`qasr-bench offline`; its options are declared in qasr.bench.cli, where --help needs no torch."""
    from .cli import offline_parser

    run(offline_parser().parse_args(argv))
