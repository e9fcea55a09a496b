"""GPU time of work as a CUDA graph replays it: the one way small kernels are timed here (the GEMV tuner, the GPU
benches).

Launched one by one from Python a small kernel measures the host's launch path (tens of microseconds a launch with
Triton's launcher) instead of its own few microseconds; in a graph, as the engine runs its decode step, it does not.
The capture is thread-local (other threads' CUDA calls go on), but it must not overlap another thread's capture in
CUDA's default global mode: the engine tunes and captures its graphs in one thread, one after the other.
"""

from __future__ import annotations

import statistics

import torch


def replay_ms(graph: torch.cuda.CUDAGraph, reset=None, runs: int = 50) -> float:
    """Median GPU time of one replay of `graph` over `runs` (after 3 untimed), reset() before each, outside the
    timing."""
    samples = []
    for _ in range(runs + 3):
        if reset is not None:
            reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples[3:])


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn() captured in a CUDA graph, after one call outside it (Triton compiles then)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads' CUDA work may go on meanwhile
        fn()
    return graph


def graphed_ms(fn, runs: int = 50) -> float:
    """replay_ms of fn() captured (capture)."""
    return replay_ms(capture(fn), runs=runs)


def per_call_ms(calls: list, runs: int = 50) -> float:
    """GPU time of one call, the thunks `calls` captured one after the other in one graph (the same call repeated, or
    one call over several weight copies so that each streams from memory): graphed_ms of them all / their number."""
    return graphed_ms(lambda: [call() for call in calls], runs) / len(calls)
