"""Does a CUDA graph run at the priority of the stream it is replayed into, or of the one it was captured on? (#17)

    python -m qasr.bench.graph_priority --out graph_priority.json     # on a GPU; ~15 s

The engine replays its decode graphs on a high-priority stream beside the aligner's low-priority one
(qasr.engine.streams); this checks that replay honours the launch stream's priority. A queue of 8192^3 bf16 GEMMs on
a priority-0 stream stands in for an alignment; a "decode-like" graph of 100 small GEMMs (128 x 2048 x 2048) + GELU,
captured once on a priority-0 stream and once on a high-priority one, is replayed into each while the queue runs, and
timed to completion (median ms). Also eager launches of the same work on each stream, and everything with the GPU
idle. Session 6 on the H200 (torch 2.11.0+cu130, driver 580.159.04): replayed into the high-priority stream 26.5 ms,
into the low one 88 ms, 0.8 ms idle, whichever stream captured it; CUDA_GRAPHS_USE_NODE_PRIORITY=0 or 1 changed
nothing. Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from .report import print_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qasr.bench.graph_priority", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_priority: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    low, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-(1 << 10))  # PyTorch clamps to its range
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    c = torch.empty_like(a)
    x = torch.randn(128, 2048, device=device, dtype=torch.bfloat16)
    weights = [torch.randn(2048, 2048, device=device, dtype=torch.bfloat16) for _ in range(8)]

    def small():
        y = x
        for i in range(100):
            y = torch.nn.functional.gelu(y @ weights[i % 8])
        return y

    def capture(stream):
        with torch.cuda.stream(stream):
            small()
            small()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            small()
        torch.cuda.synchronize()
        return graph

    graphs = {"captured_low": capture(low), "captured_high": capture(high)}

    def background():
        with torch.cuda.stream(low):
            for _ in range(60):
                torch.mm(a, b, out=c)

    def median_ms(fn, stream, busy: bool) -> float:
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            if busy:
                background()
                time.sleep(0.01)  # the queue is running on the GPU
            with torch.cuda.stream(stream):
                start = time.perf_counter()
                fn()
                stream.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        return round(statistics.median(times[3:]), 3)

    report = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
              "priorities": {"low": low.priority, "high": high.priority},
              "CUDA_GRAPHS_USE_NODE_PRIORITY": os.environ.get("CUDA_GRAPHS_USE_NODE_PRIORITY"), "ms": {}}
    for busy in (False, True):
        state = "busy" if busy else "idle"
        for name, graph in graphs.items():
            for into, stream in (("replayed_low", low), ("replayed_high", high)):
                report["ms"][f"{state} graph {name} {into}"] = median_ms(graph.replay, stream, busy)
        for into, stream in (("low", low), ("high", high)):
            report["ms"][f"{state} eager on {into}"] = median_ms(small, stream, busy)
    torch.cuda.synchronize()
    start = time.perf_counter()
    background()
    torch.cuda.synchronize()
    report["ms"]["the GEMM queue alone"] = round((time.perf_counter() - start) * 1e3, 1)
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
