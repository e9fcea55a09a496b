"""Profile one eager decode step and one prefill of the engine on a random real-shape checkpoint (kernel table)."""

from __future__ import annotations

import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from qasr.model.testmodel import make_test_model
from qasr.streaming.engine import Engine, EngineOptions
from qasr.streaming.request import DecodeRequest

from .synthetic import speech_like


def main(argv=None) -> None:
    size = (argv or sys.argv[1:] or ["0.6B"])[0]
    with tempfile.TemporaryDirectory() as tmp:
        d = make_test_model(f"{tmp}/m", size=size, dtype="bfloat16")
        opts = EngineOptions(num_slots=64, max_len=320, num_retained=0, ignore_eos=True, repetition_window=0,
                             cuda_graphs=False)
        engine = Engine.from_pretrained(str(d), device="cuda", dtype="bfloat16", options=opts)
    req = [DecodeRequest(audio=speech_like(10.9), max_new_tokens=8)]
    engine.transcribe(req)
    runner = engine.runner
    runner.positions[:1] = 200
    runner.budgets[:1] = 1 << 30
    for B in (1, 64):
        runner.positions[:B] = 200
        runner._step(B)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner._step(B)
            torch.cuda.synchronize()
        print(f"== eager decode step B={B}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    runner.positions.fill_(-1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        engine.transcribe(req)
        torch.cuda.synchronize()
        print("transcribe ms", (time.perf_counter() - t) * 1e3)
    print("== transcribe (encode + prefill + 8 eager decode steps)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
