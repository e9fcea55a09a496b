"""Where a thread's time went, from py-spy's raw folded stacks (`py-spy record --format raw`, as bench/h200_stream.sh
writes with PYSPY=N): each function's share of the thread's samples, inclusive (on the stack) and self (the innermost
frame), the busiest first.

    python -m qasr.bench.pyspy_summary OUT/pyspy-1000-r1-all.txt --process 3655 --thread MainThread

A line of the file is `frame;frame;...;frame count`; with --subprocesses the first frames name the process and its
parents (`process 3615:"...";process 3655:"..."`), with --threads one names the thread (`thread (3655): MainThread`); the rest are functions,
`name (file:line)` for Python ones, native ones (--native) by their symbol alone. A function counts once a sample however
often it recurs on the stack.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from typing import Iterable, NamedTuple

_LOCATION = re.compile(r"\s*\(([^()]*?):\d+\)$")  # " (path/to/file.py:123)"


class Shares(NamedTuple):
    samples: int
    inclusive: Counter
    self: Counter


def function_name(frame: str) -> str:
    """`name (dir/file.py:12)` -> `name [file.py]` (one entry per function, whatever the line); native as it is."""
    match = _LOCATION.search(frame)
    if not match:
        return frame.strip()
    return f"{frame[: match.start()].strip()} [{match.group(1).rsplit('/', 1)[-1]}]"


def summarize(lines: Iterable[str], process: str = "", thread: str = "") -> Shares:
    """The samples of process `process` (a pid; "" any) whose thread frame contains `thread` ("" any)."""
    samples, inclusive, innermost = 0, Counter(), Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        proc = next((f for f in reversed(frames) if f.startswith("process ")), "")  # the innermost: a subprocess's
        # stack starts with its parents' process frames
        at = next((i for i, f in enumerate(frames) if f.startswith("thread ")), -1)
        if (process and not proc.startswith(f"process {process}:")) or (thread and (at < 0 or thread not in frames[at])):
            continue
        names = [function_name(f) for f in frames[at + 1 :] if not f.startswith("process ")]
        n = int(count)
        samples += n
        inclusive.update(dict.fromkeys(names, n))  # once a sample each, in stack order (ties stay in that order)
        innermost[names[-1] if names else "?"] += n
    return Shares(samples, inclusive, innermost)


def report(shares: Shares, top: int) -> str:
    if not shares.samples:
        return "no samples matched"
    rows = [f"{shares.samples} samples", "inclusive:"]
    rows += [f"  {n / shares.samples:6.1%}  {name}" for name, n in shares.inclusive.most_common(top)]
    rows.append("self:")
    rows += [f"  {n / shares.samples:6.1%}  {name}" for name, n in shares.self.most_common(top)]
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qasr.bench.pyspy_summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="py-spy record --format raw output")
    parser.add_argument("--process", default="", help="only this process (its pid)")
    parser.add_argument("--thread", default="", help="only threads whose frame contains this (a name or tid)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    with open(args.file) as f:
        print(report(summarize(f, args.process, args.thread), args.top))


if __name__ == "__main__":
    main()
