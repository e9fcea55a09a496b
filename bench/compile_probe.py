"""Probe: torch.compile time and replay time of the decode step per bucket (0.6B shapes), logging as it goes."""

import sys
import tempfile
import time

import torch

from qasr.model.testmodel import make_test_model
from qasr.streaming.engine import Engine, EngineOptions
from qasr.streaming.request import DecodeRequest

from .synthetic import speech_like


def log(*a):
    print(*a, flush=True)


def main():
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        d = make_test_model(f"{tmp}/m", size="0.6B", dtype="bfloat16")
        opts = EngineOptions(num_slots=256, max_len=320, num_retained=0, ignore_eos=True, repetition_window=0,
                             cuda_graphs=False, compile=False)
        engine = Engine.from_pretrained(str(d), device="cuda", dtype="bfloat16", options=opts)
    log("loaded", time.perf_counter() - t)
    r = engine.runner
    r._step_fn = torch.compile(r._step, dynamic=True, fullgraph=True)
    r.buckets = (1, 64)
    for B in (64, 1):
        t = time.perf_counter()
        r._step_fn(B)
        torch.cuda.synchronize()
        log(f"compile+first B={B}: {time.perf_counter() - t:.1f}s")
    t = time.perf_counter()
    r.capture_graphs()
    log(f"capture {time.perf_counter() - t:.1f}s")
    for B in r.buckets:
        r.positions[:B] = 200
        r.budgets[:B] = 1 << 30
        ts = []
        for _ in range(30):
            r.positions[:B] = 200
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); r.graphs[B].replay(); e.record(); e.synchronize()
            ts.append(s.elapsed_time(e))
        ts.sort()
        log(f"compiled graph step B={B}: {ts[len(ts)//2]:.3f} ms")
    r.positions.fill_(-1)
    clip = speech_like(10.9)
    for i in range(3):
        t = time.perf_counter()
        (res,) = engine.transcribe([DecodeRequest(audio=clip, max_new_tokens=40)])
        log(f"bs1 10.9s/40tok: {(time.perf_counter() - t) * 1e3:.1f} ms {res.timings}")


if __name__ == "__main__":
    main()
