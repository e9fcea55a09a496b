"""Server metrics for /metrics, through `prometheus-client`.

`ServerMetrics` holds one `CollectorRegistry` per server (tests run many servers in one process; the library's
global registry would mix them) and is also the sessions' observer (partials, finals, latencies). The engine's
numbers are read at scrape time by `EngineStatsCollector` from `engine.stats()`: numbers become gauges
`qasr_engine_<key>` (those that only grow, `ENGINE_STATS_COUNTERS`, counters `qasr_engine_<key>_total`), dicts of numbers one gauge with a `kind` label, lists of numbers (e.g. recent batch sizes)
`_last`, `_mean` and `_max` gauges. Every family has a HELP line (`ENGINE_STATS_HELP`, or a generic one for a key
an engine adds later). An engine pool (qasr.engine.pool) reports each engine's stats under `engines`: the same
families with an `engine` label (the device's position in `--devices`), and its `headroom` as
`qasr_admission_headroom`.

Several front-end processes (`qasr-server --workers N`, issue #15) use the library's multi-process mode: the
supervisor sets `PROMETHEUS_MULTIPROC_DIR` (a private folder) before it spawns the workers, and then each worker's
metrics are created unregistered (their values live in that folder's files, one per process), `self.registry` holds
a `multiprocess.MultiProcessCollector` (the sum over the workers, dead ones included, so counters never go back)
plus the engine collector (the engine's numbers, shown once: every worker reads the same engine process), and
/metrics from any worker shows the same sums. `qasr_sessions_active` counts live workers only (`livesum`: the
supervisor marks a dead worker's files), and the per-process `process_*` families give way to
`qasr_worker_cpu_seconds` (all workers' CPU, dead ones included).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Iterable

import prometheus_client
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest,
                               multiprocess)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from qasr.engine.request import Priority
from qasr.streaming.session import SessionObserver

# The `_created` timestamp series (one per counter and histogram child) are off: /metrics shows what
# docs/protocol.md lists. A process-wide switch of the library; the server is its only user in the process.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # generate_latest writes the 0.0.4 text format
LATENCY_BUCKETS_S = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
LAG_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
STAGES = ("queue", "encode", "prefill", "decode")
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # set: several worker processes share the metrics (their files here)

# HELP text of the engine's stats() keys (AsyncEngine, EngineProcess and the fake engine's).
ENGINE_STATS_HELP = {
    "queue": "Requests waiting to be admitted, by priority (kind).",
    "queue_depth": "Requests waiting to be admitted, by priority (kind).",
    "running": "Sequences decoding now.",
    "free_slots": "KV-cache slots free now.",
    "active_slots": "KV-cache slots in use now.",
    "streams_cached": "Streams whose encoder windows and prompt KV are kept for their next partial.",
    "steps": "Engine steps so far.",
    "batch_sizes": "Rows of the recent decode steps.",
    "last_batch_sizes": "Rows of the recent decode steps.",
    "counters": "Engine work so far, by kind: tokens prefilled and reused, encoder windows encoded and reused, "
                "decode rows, and the prefill's and the encoder's positions computed with their padding.",
    "seconds": "The engine loop's time so far, by kind: admit, decode_gpu, decode_host, idle.",
    "thread_cpu_seconds": "CPU time of the engine loop's thread.",
    "device_memory": "The engine's CUDA caching allocator, by kind: cudaMalloc and cudaFree calls so far "
                     "(device_allocs, device_frees), allocations retried after freeing the cache (alloc_retries), "
                     "bytes reserved and allocated now.",
    "process_cpu_seconds": "CPU time of the engine process (all threads).",
    "restarts": "Engine processes replaced after one died (a device error, out of memory, a kill).",
    "streams": "Streams (segments) placed on the engine and not released (qasr.engine.pool).",
    "final_latency_ms": "The p90 latency (submit to result, as the pool saw it) of the finals the engine answered in "
                        "the last few seconds, ms: admission control's signal.",
    "final_queue_ms": "The p90 queue delay of the finals the engine answered in the last few seconds, ms.",
    "headroom": "What the engine can still take: the smaller of 1 - recent final latency / the latency target "
                "and 1 - decode rows in use / slots (1 idle, 0 at the target, below 0 past it).",
    "serving": "1 while the engine can take work (0: restarting or failed).",
    "partials_thinned": "Partials skipped because their engine was past its latency target (finals go first).",
}
# stats that only grow: shown as counters (`qasr_engine_<key>_total`)
ENGINE_STATS_COUNTERS = {"restarts", "partials_thinned"}
LIST_SUFFIX_HELP = {"last": "the last one", "mean": "their mean", "max": "their maximum"}


class ServerMetrics(SessionObserver):
    """Everything /metrics shows. Updated and rendered on the event loop only."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.engine_stats = EngineStatsCollector()
        self.multiprocess = MULTIPROCESS_ENV in os.environ  # the library decided so at import, from the same variable
        self._define(None if self.multiprocess else self.registry)
        if self.multiprocess:
            multiprocess.MultiProcessCollector(self.registry)
            self.worker_cpu = Gauge("qasr_worker_cpu_seconds", "CPU time of the front-end worker processes (all "
                                    "threads), summed.", multiprocess_mode="sum", registry=None)
        else:
            ProcessCollector(registry=self.registry)  # process_cpu_seconds_total (all threads), memory, open fds
        self.registry.register(self.engine_stats)
        self.sessions_active = 0  # a property: the gauge follows it

    def _define(self, registry: CollectorRegistry | None) -> None:
        """registry None: multi-process mode, the values go to this process's files."""
        self._sessions_active = Gauge("qasr_sessions_active", "Streams open now.", multiprocess_mode="livesum",
                                      registry=registry)
        self.sessions_total = Counter("qasr_sessions_total", "Streams started (after a valid start message).",
                                      registry=registry)
        self.connections_total = Counter("qasr_connections_total", "WebSocket connections accepted.",
                                         registry=registry)
        self.segments_total = Counter("qasr_segments_total", "Speech segments detected.", registry=registry)
        self.partials_total = Counter("qasr_partials_total", "Partial hypotheses sent.", registry=registry)
        self.finals_total = Counter("qasr_finals_total", "Final transcripts sent.", registry=registry)
        self.audio_seconds_total = Counter("qasr_audio_seconds_total", "Audio received, in seconds.",
                                           registry=registry)
        self.decode_failures_total = Counter("qasr_decode_failures_total", "Engine requests that failed.",
                                             ["priority"], registry=registry)
        self.errors_total = Counter("qasr_errors_total", "Error events sent to clients, by error code.", ["code"],
                                    registry=registry)
        self.closes_total = Counter("qasr_closes_total", "Connections closed, by WebSocket close code.", ["code"],
                                    registry=registry)
        self.webhooks_undelivered_total = Counter(
            "qasr_webhooks_undelivered_total", "Call messages a webhook never received, by reason: unreachable, "
            "http_4xx, http_5xx, queue_full, stopping.", ["reason"], registry=registry)
        self.streams_refused_total = Counter(
            "qasr_streams_refused_total", "New streams turned away, by reason: headroom (the engines are at their "
            "latency target: admission control), max_sessions, not_ready (loading or restarting), shutting_down.",
            ["reason"], registry=registry)
        self.final_latency = Histogram("qasr_final_latency_seconds",
                                       "From a segment's end decision to its final being sent.",
                                       buckets=LATENCY_BUCKETS_S, registry=registry)
        self.partial_latency = Histogram("qasr_partial_latency_seconds",
                                         "From a partial request to the partial being sent.",
                                         buckets=LATENCY_BUCKETS_S, registry=registry)
        self.engine_stage = Histogram(
            "qasr_engine_stage_seconds", "Where a request's time went in the engine: queue (waiting to be admitted), "
            "encode, prefill, decode (first token to the last).", ["priority", "stage"], buckets=LATENCY_BUCKETS_S,
            registry=registry)
        self.event_loop_tasks = Gauge("qasr_event_loop_tasks", "asyncio tasks alive in the server's event loop "
                                      "(read at each scrape: a count that grows while the streams do not is a leak).",
                                      multiprocess_mode="livesum", registry=registry)
        self.event_loop_lag = Histogram("qasr_event_loop_lag_seconds",
                                        "How late the event loop woke a timer: every stream waits this long.",
                                        buckets=LAG_BUCKETS_S, registry=registry)

    @property
    def sessions_active(self) -> int:
        return self._sessions_active_count

    @sessions_active.setter
    def sessions_active(self, count: int) -> None:
        """Connections count streams with `metrics.sessions_active += 1` / `-= 1`."""
        self._sessions_active_count = count
        self._sessions_active.set(count)

    def value(self, name: str, **labels: str) -> float | None:
        """One sample as /metrics would show it (e.g. `value("qasr_errors_total", code="malformed")`); None if
        it has not been written."""
        return self.registry.get_sample_value(name, labels)

    def loop_lagged(self, lag_s: float) -> None:
        """The event loop's watch, every 100 ms: how late its timer woke (and, with workers, this process's CPU)."""
        self.event_loop_lag.observe(lag_s)
        if self.multiprocess:
            self.worker_cpu.set(time.process_time())

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
        self.decode_failures_total.labels(priority.name.lower()).inc()

    def decoded(self, priority: Priority, timings: dict[str, float]) -> None:
        for stage in STAGES:
            if f"{stage}_ms" in timings:
                self.engine_stage.labels(priority.name.lower(), stage).observe(timings[f"{stage}_ms"] / 1e3)

    # -- connection bookkeeping ------------------------------------------------------------------------------

    def error_sent(self, code: str) -> None:
        self.errors_total.labels(code).inc()

    def connection_closed(self, close_code: int | None) -> None:
        self.closes_total.labels(str(close_code) if close_code is not None else "none").inc()

    def stream_refused(self, reason: str) -> None:
        self.streams_refused_total.labels(reason).inc()

    def webhook_undelivered(self, reason: str) -> None:
        """qasr.server.webhooks.WebhookSender's on_undelivered hook."""
        self.webhooks_undelivered_total.labels(reason).inc()

    # -- exposition ------------------------------------------------------------------------------------------

    def render(self, engine=None) -> str:
        """The whole page; `engine` (anything with `ready` and `stats()`) adds its readiness and stats."""
        self.engine_stats.engine = engine
        try:
            self.event_loop_tasks.set(len(asyncio.all_tasks()))
        except RuntimeError:  # rendered outside the event loop (a test): the last count stays
            pass
        return generate_latest(self.registry).decode()


class EngineStatsCollector:
    """A custom collector: the engine's readiness and stats() as gauges, read when /metrics is scraped."""

    def __init__(self):
        self.engine = None

    def collect(self) -> Iterable[GaugeMetricFamily]:
        engine = self.engine
        if engine is None:
            return
        yield GaugeMetricFamily("qasr_engine_ready", "1 once the model is loaded and warmed up.",
                                value=1 if engine.ready else 0)
        try:
            stats = engine.stats()
        except Exception:  # a scrape must not fail because the engine is busy starting or stopping
            return
        if "headroom" in stats:  # an engine pool's: what admission control reads (qasr.server.admission)
            yield GaugeMetricFamily("qasr_admission_headroom", ADMISSION_HEADROOM_HELP, value=stats["headroom"])
        per_engine = stats.get("engines") if isinstance(stats.get("engines"), list) else None
        for key, value in sorted(stats.items()):
            if key not in ("engines", "headroom"):
                yield from _stat_families(str(key), [((), value)])
        if per_engine:  # an engine pool: each engine's stats with an `engine` label (its device's position)
            keys = sorted({key for engine in per_engine for key in engine})
            for key in keys:
                yield from _stat_families(str(key), [((str(i),), engine[key]) for i, engine in
                                                     enumerate(per_engine) if key in engine], ("engine",))


ADMISSION_HEADROOM_HELP = ("What the engines can still take, for admission control: the best engine's headroom (1 "
                           "idle, 0 at the latency target: new streams are refused, below 0 past it).")


def _stat_families(key: str, samples: list[tuple[tuple[str, ...], object]],
                   label_names: tuple[str, ...] = ()) -> Iterable[GaugeMetricFamily]:
    """samples: (label values, the stat's value) for each engine that reports `key` (one, unlabelled, for a plain
    engine); the stat's shape decides the families, as the module's docstring says."""
    name = "qasr_engine_" + _metric_name(key)
    help_text = ENGINE_STATS_HELP.get(key, f"The engine's `{key}` statistic.")
    values = [value for _, value in samples]
    labels = list(label_names)
    if all(_is_number(v) for v in values):
        kind = CounterMetricFamily if key in ENGINE_STATS_COUNTERS else GaugeMetricFamily
        family = kind(name, help_text, labels=labels)
        for label_values, value in samples:
            family.add_metric(list(label_values), value)
        yield family
    elif all(isinstance(v, dict) and v and all(_is_number(n) for n in v.values()) for v in values):
        family = GaugeMetricFamily(name, help_text, labels=labels + ["kind"])
        for label_values, value in samples:
            for kind, number in sorted(value.items()):
                family.add_metric([*label_values, str(kind)], number)
        yield family
    elif all(isinstance(v, (list, tuple)) and v and all(_is_number(n) for n in v) for v in values):
        for suffix, pick in (("last", lambda v: v[-1]), ("mean", lambda v: sum(v) / len(v)), ("max", max)):
            family = GaugeMetricFamily(f"{name}_{suffix}", f"{help_text.rstrip('.')}: {LIST_SUFFIX_HELP[suffix]}.",
                                       labels=labels)
            for label_values, value in samples:
                family.add_metric(list(label_values), pick(value))
            yield family


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metric_name(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key.lower())
