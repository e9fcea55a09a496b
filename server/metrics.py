"""Server metrics in the Prometheus text format (version 0.0.4), written by hand: a few counters, gauges and
histograms need no dependency.

`ServerMetrics` is also the sessions' observer (partials, finals, latencies). Engine numbers come from
`engine.stats()` at scrape time: numbers become gauges `qasr_engine_<key>`, dicts of numbers one gauge with a
`kind` label, lists of numbers (e.g. recent batch sizes) `_last`, `_mean` and `_max` gauges.
"""

from __future__ import annotations

import math
import time
from typing import Iterable

from qasr.engine.request import Priority
from qasr.streaming.session import SessionObserver

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
LAG_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class Counter:
    def __init__(self, name: str, help_text: str, label: str | None = None):
        self.name, self.help, self.label = name, help_text, label
        self.values: dict[str, float] = {} if label else {"": 0.0}

    def inc(self, amount: float = 1.0, label_value: str = "") -> None:
        self.values[label_value] = self.values.get(label_value, 0.0) + amount

    def get(self, label_value: str = "") -> float:
        return self.values.get(label_value, 0.0)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        for label_value, value in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.label, label_value)} {_number(value)}"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.count, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1
                break

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        yield from self.samples()

    def samples(self, labels: str = "") -> Iterable[str]:
        """The sample lines; `labels` (`k="v",...`, as a HistogramFamily writes them) go on every one."""
        bucket = f"{labels}," if labels else ""
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            yield f'{self.name}_bucket{{{bucket}le="{_number(bound)}"}} {cumulative}'
        yield f'{self.name}_bucket{{{bucket}le="+Inf"}} {self.count}'
        total = f"{{{labels}}}" if labels else ""
        yield f"{self.name}_sum{total} {_number(self.sum)}"
        yield f"{self.name}_count{total} {self.count}"


class HistogramFamily:
    """Histograms of one name told apart by labels (created on first use)."""

    def __init__(self, name: str, help_text: str, label_names: tuple[str, ...], buckets=LATENCY_BUCKETS_S):
        self.name, self.help, self.label_names, self.buckets = name, help_text, label_names, buckets
        self.children: dict[tuple[str, ...], Histogram] = {}

    def observe(self, value: float, *label_values: str) -> None:
        child = self.children.get(label_values)
        if child is None:
            child = self.children[label_values] = Histogram(self.name, self.help, self.buckets)
        child.observe(value)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        for values, child in sorted(self.children.items()):
            yield from child.samples(",".join(f'{k}="{_escape(v)}"' for k, v in zip(self.label_names, values)))


class ServerMetrics(SessionObserver):
    """Everything /metrics shows. Updated and rendered on the event loop only."""

    def __init__(self):
        self.sessions_active = 0
        self.sessions_total = Counter("qasr_sessions_total", "Streams started (after a valid start message).")
        self.connections_total = Counter("qasr_connections_total", "WebSocket connections accepted.")
        self.segments_total = Counter("qasr_segments_total", "Speech segments detected.")
        self.partials_total = Counter("qasr_partials_total", "Partial hypotheses sent.")
        self.finals_total = Counter("qasr_finals_total", "Final transcripts sent.")
        self.audio_seconds_total = Counter("qasr_audio_seconds_total", "Audio received, in seconds.")
        self.decode_failures_total = Counter("qasr_decode_failures_total", "Engine requests that failed.",
                                             label="priority")
        self.errors_total = Counter("qasr_errors_total", "Error events sent to clients, by error code.", label="code")
        self.closes_total = Counter("qasr_closes_total", "Connections closed, by WebSocket close code.",
                                    label="code")
        self.final_latency = Histogram("qasr_final_latency_seconds",
                                       "From a segment's end decision to its final being sent.")
        self.partial_latency = Histogram("qasr_partial_latency_seconds",
                                         "From a partial request to the partial being sent.")
        self.engine_stage = HistogramFamily(
            "qasr_engine_stage_seconds", "Where a request's time went in the engine: queue (waiting to be admitted), "
            "encode, prefill, decode (first token to the last).", ("priority", "stage"))
        self.event_loop_lag = Histogram("qasr_event_loop_lag_seconds",
                                        "How late the event loop woke a timer: every stream waits this long.",
                                        buckets=LAG_BUCKETS_S)

    # -- SessionObserver -------------------------------------------------------------------------------------

    def segment_started(self) -> None:
        self.segments_total.inc()

    def partial_sent(self, latency_s: float) -> None:
        self.partials_total.inc()
        self.partial_latency.observe(latency_s)

    def final_sent(self, latency_s: float) -> None:
        self.finals_total.inc()
        self.final_latency.observe(latency_s)

    def decode_failed(self, priority: Priority) -> None:
        self.decode_failures_total.inc(label_value=priority.name.lower())

    def decoded(self, priority: Priority, timings: dict[str, float]) -> None:
        for stage in ("queue", "encode", "prefill", "decode"):
            if f"{stage}_ms" in timings:
                self.engine_stage.observe(timings[f"{stage}_ms"] / 1e3, priority.name.lower(), stage)

    # -- connection bookkeeping ------------------------------------------------------------------------------

    def error_sent(self, code: str) -> None:
        self.errors_total.inc(label_value=code)

    def connection_closed(self, close_code: int | None) -> None:
        self.closes_total.inc(label_value=str(close_code) if close_code is not None else "none")

    # -- exposition ------------------------------------------------------------------------------------------

    def render(self, engine=None) -> str:
        """The whole page; `engine` adds its readiness and stats()."""
        lines = [
            "# HELP qasr_sessions_active Streams open now.",
            "# TYPE qasr_sessions_active gauge",
            f"qasr_sessions_active {self.sessions_active}",
            "# HELP process_cpu_seconds_total CPU time of the server process (all threads).",
            "# TYPE process_cpu_seconds_total counter",
            f"process_cpu_seconds_total {_number(time.process_time())}",
        ]
        for metric in (self.sessions_total, self.connections_total, self.segments_total, self.partials_total,
                       self.finals_total, self.audio_seconds_total, self.decode_failures_total, self.errors_total,
                       self.closes_total, self.final_latency, self.partial_latency, self.engine_stage,
                       self.event_loop_lag):
            lines.extend(metric.render())
        if engine is not None:
            lines.extend(_engine_lines(engine))
        return "\n".join(lines) + "\n"


def _engine_lines(engine) -> Iterable[str]:
    yield "# HELP qasr_engine_ready 1 once the model is loaded and warmed up."
    yield "# TYPE qasr_engine_ready gauge"
    yield f"qasr_engine_ready {1 if engine.ready else 0}"
    try:
        stats = engine.stats()
    except Exception:  # a scrape must not fail because the engine is busy starting or stopping
        return
    for key, value in sorted(stats.items()):
        name = "qasr_engine_" + _metric_name(key)
        if _is_number(value):
            yield f"# TYPE {name} gauge"
            yield f"{name} {_number(value)}"
        elif isinstance(value, dict) and value and all(_is_number(v) for v in value.values()):
            yield f"# TYPE {name} gauge"
            for kind, number in sorted(value.items()):
                yield f"{name}{_labels('kind', str(kind))} {_number(number)}"
        elif isinstance(value, (list, tuple)) and value and all(_is_number(v) for v in value):
            for suffix, number in (("last", value[-1]), ("mean", sum(value) / len(value)), ("max", max(value))):
                yield f"# TYPE {name}_{suffix} gauge"
                yield f"{name}_{suffix} {_number(number)}"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metric_name(key) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in str(key).lower())


def _labels(label: str | None, value: str) -> str:
    return f'{{{label}="{_escape(value)}"}}' if label else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)
