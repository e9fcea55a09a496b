"""CUDA stream priorities: decoding ahead of word alignment on a shared GPU (#17).

The aligner's forward runs beside the decode steps on a stream of its own (qasr.engine.aligner_runner). Both
streams share the SMs, and at the same priority a 32-final alignment tripled the decode step (docs/benchmarks.md).
A stream's priority decides whose waiting thread blocks the GPU schedules first when an SM frees up: kernels already
running are never preempted, so priority cuts the decode step's wait, not all of it.

CUDA's default priority, 0, is also its lowest (PyTorch's range is 0 down to -3, lower is higher), so the aligner
cannot go below decoding: decoding has to go above it. The engine thread decodes on `decode_stream()` (the highest
priority PyTorch gives), queues each admission's device work (mel, convolutions, encoder, prefill) on
`admission_stream()`, one step below, so that a decode step launched while an admission runs does not wait behind it
(#15: at 1000 streams the steps queued behind admissions made finals wait ~18 ms per token), and the aligner stays at
`ALIGNER_PRIORITY`. A CUDA graph launched into a stream
runs at that stream's priority, whatever stream it was captured on: measured (bench/graph_priority.py) on the H200
with PyTorch 2.11 / CUDA 13.0 (a graph of 100 small GEMMs and their GELUs beside a queue of 8192^3 GEMMs on a
priority-0 stream: 88 ms launched into a priority-0 stream, 26.5 ms into a priority -3 one, 0.8 ms alone, the same
for graphs captured on either stream; the CUDA_GRAPHS_USE_NODE_PRIORITY environment variable changed nothing).

Off CUDA there are no streams: every helper returns None, and `torch.cuda.stream(None)` is a no-op context.
"""

from __future__ import annotations

import functools

import torch

ALIGNER_PRIORITY = 0  # CUDA's lowest (and default) priority
ADMISSION_PRIORITY = -1  # above the aligner, below decoding
HIGHEST_PRIORITY = -(1 << 10)  # PyTorch clamps a priority to its range: this asks for its highest


def decode_stream(device: torch.device | str) -> "torch.cuda.Stream | None":
    """A stream of the highest priority PyTorch gives on `device`, for decode steps and admissions (None off CUDA).
    It starts after what the calling thread's current stream has queued (the model's load, the graphs' capture), so
    the buffers made there are ready when it first reads them. Make it once and keep it: PyTorch hands out streams
    from a small pool per priority, round robin."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device, priority=HIGHEST_PRIORITY)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def admission_stream(device: torch.device | str) -> "torch.cuda.Stream | None":
    """A stream between decoding and the aligner in priority, for admissions' device work (None off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device, priority=ADMISSION_PRIORITY)


def aligner_stream(device: torch.device | str) -> "torch.cuda.Stream | None":
    """A stream of the lowest priority on `device`, for the aligner's forward (None off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device, priority=ALIGNER_PRIORITY)


def on_own_stream(method):
    """Decorates an engine method to run with its object's `stream` (from `decode_stream()`) as the thread's current
    stream, so that everything it queues (graph replays, copies, eager kernels) goes there; no stream (None, or no
    `stream` attribute): the thread's current stream, as before."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with torch.cuda.stream(getattr(self, "stream", None)):  # a no-op context for None
            return method(self, *args, **kwargs)

    return run
