"""A serving engine's GPU timeline: torch's profiler over a short window of live load, summed by CUDA stream.

nvidia-smi says how busy the GPU was and py-spy where the engine thread's time went; neither says which work holds
the GPU while the engine waits for it. At 1,000 streams (#15) the engine thread waited for decode steps ~35% of its
time while nvidia-smi had the GPU ~55% busy on average. This measures the split: per CUDA stream (decoding, the
admissions, the aligner each have their own), the time it kept the GPU busy, its kernels by total time, and how much
of the window the GPU ran nothing at all, in stretches of which lengths (launch gaps, or waits for host work).

Off by default. `$QASR_ENGINE_PROFILE=DIR` arms it in every engine process; writing a label into DIR/start (`echo
1000-r3 > DIR/start`) opens a window of `$QASR_ENGINE_PROFILE_S` seconds (default 2) at the engine's next step, after
which each engine process writes DIR/engine-<pid>-<label>.json. A new label opens a new window. The trace itself is
not kept (at 1,000 streams ~70,000 kernels a second).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterable, NamedTuple

log = logging.getLogger(__name__)

PROFILE_ENV = "QASR_ENGINE_PROFILE"
PROFILE_SECONDS_ENV = "QASR_ENGINE_PROFILE_S"
TRIGGER_POLL_S = 0.5  # how often the engine looks for a new label (a stat() per look)
TOP_KERNELS = 30  # enough to name what is left once the largest are fused (the JSON stays small)
# the GPU's idle stretches by length: launch gaps between kernels (under 10-100 us) are the host keeping up with the
# device kernel by kernel; stretches of milliseconds are the device waiting for a whole piece of host work
IDLE_EDGES_US = (10.0, 100.0, 1_000.0, 10_000.0)
LONGEST_GAPS = 10


class Kernel(NamedTuple):
    stream: int
    name: str
    start_us: float
    duration_us: float


def busy_us(kernels: Iterable[Kernel]) -> float:
    """How long at least one of `kernels` ran: the length of the union of their intervals."""
    total, reach = 0.0, float("-inf")
    for start, duration in sorted((k.start_us, k.duration_us) for k in kernels):
        end = start + duration
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def idle_gaps(kernels: Iterable[Kernel]) -> list[tuple[float, float]]:
    """(start_us, length_us) of each stretch between the first kernel's start and the last one's end in which none of
    `kernels` ran."""
    gaps, reach = [], None
    for start, duration in sorted((k.start_us, k.duration_us) for k in kernels):
        if reach is not None and start > reach:
            gaps.append((reach, start - reach))
        reach = start + duration if reach is None else max(reach, start + duration)
    return gaps


def idle_summary(kernels: list[Kernel], window_us: float) -> dict:
    """Where the GPU ran nothing: its idle time by the length of the stretch (IDLE_EDGES_US), the longest stretches
    (ms after the first kernel's start), and the window's time before the first kernel or after the last."""
    gaps = idle_gaps(kernels)
    edges = (0.0, *IDLE_EDGES_US, float("inf"))
    by_length = {}
    for low, high in zip(edges, edges[1:]):
        inside = [length for _, length in gaps if low <= length < high]
        name = f"{low:g}-{high:g} us" if high != float("inf") else f">= {low:g} us"
        by_length[name] = {"count": len(inside), "ms": sum(inside) / 1e3}
    first = min((k.start_us for k in kernels), default=0.0)
    span = max((k.start_us + k.duration_us for k in kernels), default=first) - first
    longest = sorted(gaps, key=lambda gap: -gap[1])[:LONGEST_GAPS]
    return {
        "between_kernels_ms": sum(length for _, length in gaps) / 1e3,
        "by_length": by_length,
        "longest": [{"at_ms": (start - first) / 1e3, "ms": length / 1e3} for start, length in longest],
        "outside_kernels_ms": max(0.0, window_us - span) / 1e3,  # the window's head and tail
    }


def summarize(kernels: list[Kernel], window_s: float) -> dict:
    """What ran on the GPU during a window of `window_s` seconds: per stream (the busiest first) and in all."""
    window_us = window_s * 1e6
    by_stream: dict[int, list[Kernel]] = defaultdict(list)
    for k in kernels:
        by_stream[k.stream].append(k)
    streams = {}
    for stream, ks in by_stream.items():
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for k in ks:
            totals[k.name][0] += 1
            totals[k.name][1] += k.duration_us
        top = sorted(totals.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
        busy = busy_us(ks)
        streams[str(stream)] = {
            "kernels": len(ks),
            "busy_ms": busy / 1e3,
            "busy_fraction": busy / window_us if window_us else 0.0,
            "top_kernels": [{"name": name[:100], "count": count, "ms": us / 1e3} for name, (count, us) in top],
        }
    busy = busy_us(kernels)
    return {
        "window_s": window_s,
        "kernels": len(kernels),
        "gpu_busy_fraction": busy / window_us if window_us else 0.0,  # any stream running something
        "streams_overlap_ms": (sum(s["busy_ms"] for s in streams.values()) - busy / 1e3),  # two or more at once
        "streams": dict(sorted(streams.items(), key=lambda item: -item[1]["busy_ms"])),
        "idle": idle_summary(kernels, window_us),
    }


def kernels_of(prof, device_type: str) -> list[Kernel]:
    """The device work a finished torch profiler saw: on CUDA its kernels, copies and fills (by stream); on the CPU
    (tests) its operators (by thread)."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.profiler.kineto_results.events():
        if device_type == "cuda":
            if e.device_type() != DeviceType.CUDA:
                continue
        elif e.device_type() != DeviceType.CPU or e.activity_type() != "cpu_op":
            continue
        out.append(Kernel(e.device_resource_id(), e.name(), e.start_ns() / 1e3, e.duration_ns() / 1e3))
    return out


class EngineProfiler:
    """Opens a profiler window when a new label appears in its directory (see the module's docstring); `after_step`
    is called by the engine loop after every step, on its thread."""

    def __init__(self, directory: Path, seconds: float, device_type: str, poll_s: float = TRIGGER_POLL_S):
        self.directory, self.seconds, self.device_type, self.poll_s = directory, seconds, device_type, poll_s
        self._last_look = float("-inf")
        self._label: str | None = None  # of the last window opened
        self._prof = None
        self._opened = 0.0

    @classmethod
    def from_env(cls, device_type: str) -> EngineProfiler | None:
        directory = os.environ.get(PROFILE_ENV)
        if not directory:
            return None
        seconds = float(os.environ.get(PROFILE_SECONDS_ENV, "2"))
        if not seconds > 0:
            raise ValueError(f"{PROFILE_SECONDS_ENV} must be a positive number of seconds, got {seconds}")
        Path(directory).mkdir(parents=True, exist_ok=True)
        log.info("engine profiler armed: write a label into %s/start for a %g s window", directory, seconds)
        return cls(Path(directory), seconds, device_type)

    def after_step(self) -> None:
        """Never raises: a profiler that cannot start (no CUPTI, say) is logged and disarmed, the engine goes on."""
        try:
            self._after_step()
        except Exception:
            log.warning("the engine profiler failed and is off from now on", exc_info=True)
            self.poll_s, self._prof = float("inf"), None

    def _after_step(self) -> None:
        now = time.monotonic()
        if self._prof is not None:
            if now - self._opened >= self.seconds:
                self.close()
            return
        if now - self._last_look < self.poll_s:
            return
        self._last_look = now
        label = self._requested_label()
        if label is not None and label != self._label:
            self._open(label)

    def _requested_label(self) -> str | None:
        try:
            label = (self.directory / "start").read_text().strip()
        except OSError:
            return None
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in label) or None

    def _open(self, label: str) -> None:
        from torch.profiler import ProfilerActivity, profile

        activity = ProfilerActivity.CUDA if self.device_type == "cuda" else ProfilerActivity.CPU
        self._label, self._prof = label, profile(activities=[activity])
        self._prof.__enter__()
        self._opened = time.monotonic()

    def close(self) -> None:
        """End the window open (if any) and write its summary. A failure is logged, never raised: the profile is a
        measurement, and the engine process's exit (after a device error, say) must go on."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        try:
            self._write(prof)
        except Exception:
            log.warning("the engine profile of %s could not be written", self._label, exc_info=True)

    def _write(self, prof) -> None:
        if self.device_type == "cuda":
            import torch

            torch.cuda.synchronize()  # the window's kernels all finished (and recorded)
        window_s = time.monotonic() - self._opened
        prof.__exit__(None, None, None)
        summary = summarize(kernels_of(prof, self.device_type), window_s)
        summary["label"] = self._label
        path = self.directory / f"engine-{os.getpid()}-{self._label}.json"
        path.write_text(json.dumps(summary, indent=1))
        log.info("engine profile of %.1f s written to %s", window_s, path)
