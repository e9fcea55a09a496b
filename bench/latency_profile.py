"""Where a batch-1 request's time goes outside its decode steps (#16's 30 ms for a 10.9 s clip).

The offline bench's breakdown (`qasr_bs1_breakdown_ms`) puts ~4.8 ms of a 42.7 ms clip in `encode_ms` (H100, session
36) where the mel, the convolutions and the encoder are well under a millisecond of GPU work: that stage is host time.
This runs the offline bench's engine on one clip, `--runs` times, and reports:
- the engine's own breakdown (queue, encode, prefill, decode; medians);
- host time a request in each admission function (runner and audio front end; wall time around each call, nothing
  synchronized, so a function that waits for the device shows that wait; admission_overlap.phase_timers wraps them);
- from the PyTorch profiler (CPU and CUDA): the host calls that wait for the device (synchronizations, copies) with
  their time, the CPU ops by self time, and the GPU kernels a request with their summed time (kernels that
  programmatic dependent launch overlaps count twice there: not the GPU's busy time). `--trace` keeps the timeline,
  where each request's admission shows as the span from the last request's final step to its first.

`python -m qasr.bench.latency_profile --model DIR [--runs 20] [--trace OUT.json]` on a CUDA machine; prints one JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from qasr.engine.engine import Engine

from .admission_overlap import phase_timers
from .offline import _sync, batch1_latency, offline_options, requests
from .synthetic import speech_like

# the admission's functions, timed as admission_overlap's phases are: (name, owner, method)
CALLS = tuple((f"{owner}.{name}", owner, name) for owner, names in (
    ("runner", ("stage_samples", "log_spectrogram", "chunk_extremes", "floor_log_spectrogram", "embed_chunks",
                "encode", "embed_prompts", "prefill", "start_rows", "to_device")),
    ("frontend", ("prepare", "run")),
    ("engine", ("_prepare", "_encode", "_admit_together", "_start_admitted"))) for name in names)
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def per_request(spent: dict[str, list], runs: int) -> dict[str, dict[str, float]]:
    """phase_timers' {name: [calls, seconds]} -> each function called, its calls and ms a request."""
    return {name: {"calls_a_request": calls / runs, "ms_a_request": seconds * 1e3 / runs}
            for name, (calls, seconds) in sorted(spent.items()) if calls}


def profile_summary(prof, runs: int, top: int = 25) -> dict:
    events = prof.key_averages()
    waits = {e.key: {"calls_a_request": e.count / runs, "ms_a_request": e.cpu_time_total / 1e3 / runs}
             for e in events if e.key in WAITS}
    cpu = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)[:top]
    gpu = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return {"waits": waits,
            "cpu_self_ms_a_request": {e.key: round(e.self_cpu_time_total / 1e3 / runs, 4) for e in cpu},
            "cpu_calls_a_request": {e.key: e.count / runs for e in cpu},
            "gpu_kernels_a_request": len(gpu) / runs,
            "gpu_kernel_ms_a_request": sum(e.time_range.end - e.time_range.start for e in gpu) / 1e3 / runs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m qasr.bench.latency_profile")
    p.add_argument("--model", required=True, help="a checkpoint folder (python -m qasr.model.testmodel makes one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--clip-seconds", type=float, default=10.9)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--max-len", type=int, default=320)
    p.add_argument("--prefill-tokens", type=int, default=65536)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--trace", help="write the profiler's Chrome trace of the profiled requests here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    engine = Engine.from_pretrained(args.model, device=device, dtype=args.dtype,
                                    options=offline_options(args.slots, args.max_len, args.prefill_tokens))
    clip = speech_like(args.clip_seconds, seed=1)
    for _ in range(3):
        engine.transcribe(requests([clip], args.tokens))
    out: dict = {}
    with phase_timers(engine, CALLS) as spent:
        out["latency_ms"], out["breakdown_ms"] = batch1_latency(engine, clip, args.tokens, args.runs, device)
    out["host_calls"] = per_request(spent, args.runs)
    profiled = max(3, args.runs // 4)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(profiled):
            engine.transcribe(requests([clip], args.tokens))
        _sync(device)
    out["profile"] = profile_summary(prof, profiled)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
