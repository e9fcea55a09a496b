"""`python -m qasr.bench.host_speed [--device cuda]`: how fast this host runs the engine thread's kind of work.

On the H200 the same code and load gave 87-127 decode steps a second on one lease and 155-191 on others (#15,
docs/benchmarks.md session 13), and the lease's CPU names itself only "Intel(R) Xeon(R) Processor". The engine thread's
time is Python, torch's dispatch and kernel launches; this times each of those alone, so that a run's figures can be
read beside the speed of the host that made them (bench/h200_stream.sh prints it first):
- python: a fixed pure-Python loop (ms);
- dispatch: a small torch op on the CPU, us a call (torch's dispatcher, no kernel worth timing);
- launch: a tiny kernel queued on the device, us a launch (on CUDA: the launch path; elsewhere the CPU op again).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def best_of(fn, repeats: int = 5) -> float:
    """The least of `repeats` timings of fn() in seconds: the host's speed, not its interruptions."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def python_loop(n: int = 1_000_000) -> int:
    total = 0
    for i in range(n):
        total += i & 7
    return total


def measure(device: torch.device, calls: int = 2000) -> dict:
    cpu = torch.ones(16)
    target = torch.ones(16, device=device)

    def dispatch():
        for _ in range(calls):
            cpu.add(1)

    def launch():
        for _ in range(calls):
            target.add_(1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    launch()  # first use: CUDA context, kernel load
    return {"device": str(device), "python_loop_ms": best_of(python_loop) * 1e3,
            "dispatch_us": best_of(dispatch) / calls * 1e6, "launch_us": best_of(launch) / calls * 1e6,
            "cpu_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m qasr.bench.host_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of one line")
    args = p.parse_args(argv)
    r = measure(torch.device(args.device))
    print(json.dumps(r) if args.json else
          f"host speed: python loop {r['python_loop_ms']:.1f} ms, torch dispatch {r['dispatch_us']:.2f} us a call, "
          f"{r['device']} launch {r['launch_us']:.2f} us a kernel")


if __name__ == "__main__":
    main()
