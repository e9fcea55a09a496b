"""Profile the engine on a random real-shape checkpoint: one decode step (B=1 and B=256) and one large admission
(encode + prefill of many clips), as kernel tables. `python -m qasr.bench.profile_decode [0.6B|1.7B]` on CUDA."""

from __future__ import annotations

import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from qasr.model.testmodel import make_test_model
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest

from .synthetic import speech_like


def table(prof, sort_by: str, rows: int = 22) -> str:
    return prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=70)


def main(argv=None) -> None:
    size = (argv or sys.argv[1:] or ["0.6B"])[0]
    with tempfile.TemporaryDirectory() as tmp:
        d = make_test_model(f"{tmp}/m", size=size, dtype="bfloat16")
        opts = EngineOptions(num_slots=256, max_len=320, num_retained=0, ignore_eos=True, repetition_window=0,
                             max_prefill_tokens=32768)
        engine = Engine.from_pretrained(str(d), device="cuda", dtype="bfloat16", options=opts)
    runner = engine.runner
    print("fused kernels:", runner.fused_kernels)
    engine.transcribe([DecodeRequest(audio=speech_like(10.9), max_new_tokens=2)])
    runner.budgets.fill_(1 << 30)
    for B in (1, 256):
        runner.positions[:B] = 200
        runner._step(B)
        torch.cuda.synchronize()
        runner.positions[:B] = 200
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner._step(B)
            torch.cuda.synchronize()
        print(f"== eager decode step B={B} (GPU time per kernel; the graph removes only the launch cost)")
        print(table(prof, "cuda_time_total"))
    runner.positions.fill_(-1)
    clips = [speech_like(10.9, seed=i) for i in range(188)]
    reqs = [DecodeRequest(audio=c, max_new_tokens=1) for c in clips]
    engine.transcribe(reqs)  # warm the shapes
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.transcribe(reqs)
    torch.cuda.synchronize()
    print(f"admission of 188 x 10.9 s clips (1 token each): {(time.perf_counter() - t) * 1e3:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.transcribe(reqs)
        torch.cuda.synchronize()
    print("== admission of 188 clips, by GPU time")
    print(table(prof, "cuda_time_total", 30))
    print("== admission of 188 clips, by CPU time")
    print(table(prof, "cpu_time_total", 30))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"default": None, "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                              SDPBackend.MATH]}
    for name, allowed in backends.items():
        for n in (1, 16, 188):
            reqs = [DecodeRequest(audio=c, max_new_tokens=1) for c in clips[:n]]
            parts = []
            for _ in range(6):
                with sdpa_kernel(allowed) if allowed else torch.autograd.profiler.record_function("default"):
                    engine.transcribe(reqs)  # warm
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    (r, *_) = engine.transcribe(reqs)
                    torch.cuda.synchronize()
                parts.append(((time.perf_counter() - t) * 1e3, r.timings["encode_ms"], r.timings["prefill_ms"]))
            parts.sort()
            total, enc, pre = parts[len(parts) // 2]
            print(f"sdpa {name}: admission of {n} clips: {total:.1f} ms (encode {enc:.1f}, prefill {pre:.1f})")
    for label, n in (("bs1", 1), ("bs16", 16)):
        reqs = [DecodeRequest(audio=c, max_new_tokens=1) for c in clips[:n]]
        engine.transcribe(reqs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.transcribe(reqs)
            torch.cuda.synchronize()
        print(f"== admission {label}, by CPU time")
        print(table(prof, "cpu_time_total", 25))


if __name__ == "__main__":
    main()
