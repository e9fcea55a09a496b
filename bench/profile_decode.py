"""Where the GPU's time goes, by kernel, on a random real-shape checkpoint (#15, #16): the decode step's graph replay
at several buckets, and a live-like admission (partials of streams that kept their earlier chunks, and finals) with the
operator and input shapes behind each kernel. (Session 9's side-by-side variants of the first conv and of the decode
attention's tiles, decided and recorded in docs/benchmarks.md, are in `72fa962`; its int8 KV cache, measured slower
than bf16 at every bucket and removed in session 10, is in `3dd9d82`.)

    python -m qasr.bench.profile_decode [0.6B|1.7B] [--sections step,layer,admission]    # on CUDA, ~2 min

`layer` times each kernel of the step by its place in a layer (the step is the same kernels layer after layer), so the
four products that share gemv.py's kernel name are told apart. Run it with QASR_PDL=0 to read each kernel's own time:
with PDL a kernel's span includes the time its programs waited for the one before.

Prints one JSON object per line, a section each (a time limit leaves the sections that finished), and the admission's
operator table as text.
"""

from __future__ import annotations

import json
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest, Priority
from qasr.model.testmodel import make_test_model

from . import kernel_check
from .kernel_check import size_and_sections
from .synthetic import speech_like

SECTIONS = ("step", "layer", "admission")
LAYER_BUCKETS = (1, 32)
NOT_THE_STEP = ("Memcpy", "Memset", "void at::native::vect")  # profiled kernels of the positions' reset, not the step
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


def fill_cache(cache) -> None:
    """Random keys and values."""
    gen = torch.Generator(device=cache.k[0].device).manual_seed(0)
    for t in cache.tensors:
        t.normal_(generator=gen)


def step_ms(engine: Engine, runs: int = 30) -> dict:
    """Each bucket's graphed decode step, every row live at CONTEXT: median GPU ms a replay."""
    return {B: round(kernel_check.step_ms(engine.runner, B, CONTEXT, runs), 4) for B in STEP_BUCKETS}


def profiled_step(runner, B: int, replays: int):
    """The profiler's record of `replays` replays of bucket B's graphed step, every row live at CONTEXT (set before
    each: the same work every replay), after one unrecorded replay."""
    runner.positions[:B] = CONTEXT
    runner.graphs[B].replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            runner.positions[:B] = CONTEXT
            runner.graphs[B].replay()
        torch.cuda.synchronize()
    return prof


def step_section(engine: Engine, replays: int = 20) -> dict:
    """Each bucket's graphed decode step, every row live at CONTEXT: GPU time per kernel per step."""
    runner = engine.runner
    fill_cache(runner.cache)
    runner.budgets.fill_(1 << 30)
    out = {}
    for B in STEP_BUCKETS:
        out[B] = kernel_times(profiled_step(runner, B, replays), replays)
        out[B]["kernels"] = {k: v for k, v in out[B]["kernels"].items() if not k.startswith(NOT_THE_STEP)}
    runner.positions.fill_(-1)
    return out


def layer_section(engine: Engine, replays: int = 20) -> dict:
    """The graphed step at LAYER_BUCKETS, every row live at CONTEXT: each kernel's mean GPU time (us) by its place
    in the step: the kernels before the first layer, each place of a layer (averaged over the layers), the kernels
    after the last; with the sum of the spans and the replay's time, whose gap is the GPU idle between kernels."""
    runner = engine.runner
    layers = len(engine.model.decoder.layers)
    fill_cache(runner.cache)
    runner.budgets.fill_(1 << 30)
    out = {}
    for B in LAYER_BUCKETS:
        events = sorted((e for e in profiled_step(runner, B, replays).events() if e.device_type.name == "CUDA"
                         and not e.name.startswith(NOT_THE_STEP)), key=lambda e: e.time_range.start)
        out[B] = places(events, replays, layers) | {"replay_ms": round(kernel_check.step_ms(runner, B, CONTEXT), 4)}
    runner.positions.fill_(-1)
    return out


def places(events: list, replays: int, layers: int, before: int = 1) -> dict:
    """Profiler events of `replays` steps in start order -> mean us per place (see layer_section); `before`: the
    kernels ahead of the first layer (decode_begin). A step whose kernels do not split into layers of the same
    kernels in the same order (fewer than a layer's worth after the last) is reported by count only."""
    per_step = len(events) // replays
    per_layer, after = divmod(per_step - before, layers)
    out = {"kernels_per_step": per_step, "sum_us": round(sum(e.time_range.elapsed_us() for e in events) / replays, 1)}
    if len(events) % replays or per_step <= before or per_layer <= 0:
        return out
    names = [e.name[:60] for e in events[:per_step]]
    if any(e.name[:60] != names[i % per_step] for i, e in enumerate(events)) or any(
            names[before + i * per_layer + j] != names[before + j] for i in range(layers) for j in range(per_layer)):
        return out
    spans = [[] for _ in range(per_step)]
    for i, e in enumerate(events):
        spans[i % per_step].append(e.time_range.elapsed_us())
    mean = lambda xs: round(sum(xs) / len(xs), 2)  # noqa: E731
    layer = [(names[before + j], mean([t for i in range(layers) for t in spans[before + i * per_layer + j]]))
             for j in range(per_layer)]
    ends = range(per_step - after, per_step)
    return out | {"before": [(names[i], mean(spans[i])) for i in range(before)], "layer": layer,
                  "after": [(names[i], mean(spans[i])) for i in ends]}


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


def main(argv=None) -> None:
    size, sections = size_and_sections("python -m qasr.bench.profile_decode", SECTIONS, argv)
    with tempfile.TemporaryDirectory() as tmp:
        d = make_test_model(f"{tmp}/m", size=size, dtype="bfloat16")
        # the stream bench's server: 256 decode rows, 640 positions, streams' prefixes retained
        opts = EngineOptions(num_slots=256, max_len=640, num_retained=64, ignore_eos=True, repetition_window=0)
        engine = Engine.from_pretrained(str(d), device="cuda", dtype="bfloat16", options=opts)

    def emit(section: str, value) -> None:
        print(json.dumps({section: value}), flush=True)

    emit("size", size)
    if "step" in sections:
        emit("decode_step_kernels_us", step_section(engine))
    if "layer" in sections:
        emit("decode_step_by_place_us", layer_section(engine))
    if "admission" in sections:
        emit("admission_kernels_us", admission_section(engine))


if __name__ == "__main__":
    main()
