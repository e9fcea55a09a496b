"""ServerMetrics on its own: the exposition prometheus-client writes, one registry per server, HELP on every family
(the engine's stats included), and the shapes engine stats take."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qasr.engine.request import Priority
from qasr.server.metrics import ServerMetrics


class StubEngine:
    def __init__(self, stats: dict | Exception, ready: bool = True):
        self._stats, self.ready = stats, ready

    def stats(self) -> dict:
        if isinstance(self._stats, Exception):
            raise self._stats
        return self._stats


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(text: str, name: str, **labels) -> float:
    found = [s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, text)
    return found[0]


def test_observer_calls_show_under_their_documented_names_and_labels():
    metrics = ServerMetrics()
    metrics.sessions_active += 2
    metrics.sessions_active -= 1
    metrics.sessions_total.inc()
    metrics.audio_seconds_total.inc(1.5)
    metrics.segment_started()
    metrics.partial_sent(0.04)
    metrics.final_sent(0.3)
    metrics.final_sent(20.0)
    metrics.decode_failed(Priority.PARTIAL)
    metrics.decoded(Priority.FINAL, {"queue_ms": 30.0, "decode_ms": 60.0, "other_ms": 1.0})
    metrics.error_sent("malformed")
    metrics.connection_closed(1000)
    metrics.connection_closed(None)
    metrics.webhook_undelivered("http_4xx")
    metrics.event_loop_lag.observe(0.003)
    text = metrics.render()

    assert sample(text, "qasr_sessions_active") == 1 and metrics.sessions_active == 1
    assert sample(text, "qasr_sessions_total") == 1 and sample(text, "qasr_audio_seconds_total") == 1.5
    assert sample(text, "qasr_segments_total") == 1 and sample(text, "qasr_partials_total") == 1
    assert sample(text, "qasr_finals_total") == 2
    assert sample(text, "qasr_decode_failures_total", priority="partial") == 1
    assert sample(text, "qasr_errors_total", code="malformed") == 1
    assert sample(text, "qasr_closes_total", code="1000") == 1 and sample(text, "qasr_closes_total", code="none") == 1
    assert sample(text, "qasr_webhooks_undelivered_total", reason="http_4xx") == 1
    assert sample(text, "qasr_final_latency_seconds_bucket", le="0.3") == 1
    assert sample(text, "qasr_final_latency_seconds_bucket", le="10.0") == 1  # 20 s is past the last bound
    assert sample(text, "qasr_final_latency_seconds_bucket", le="+Inf") == 2
    assert sample(text, "qasr_final_latency_seconds_sum") == pytest.approx(20.3)
    assert sample(text, "qasr_partial_latency_seconds_bucket", le="0.05") == 1
    assert sample(text, "qasr_engine_stage_seconds_sum", priority="final", stage="queue") == pytest.approx(0.03)
    assert sample(text, "qasr_engine_stage_seconds_bucket", priority="final", stage="decode", le="0.05") == 0
    assert sample(text, "qasr_engine_stage_seconds_bucket", priority="final", stage="decode", le="0.1") == 1
    assert not [s for s in families(text)["qasr_engine_stage_seconds"].samples if s.labels["stage"] == "other"]
    assert sample(text, "qasr_event_loop_lag_seconds_bucket", le="0.005") == 1
    assert sample(text, "process_cpu_seconds_total") > 0
    assert "_created" not in text  # the library's creation timestamps are switched off
    assert metrics.value("qasr_errors_total", code="malformed") == 1
    assert metrics.value("qasr_errors_total", code="never-sent") is None


def test_each_server_has_its_own_registry():
    first, second = ServerMetrics(), ServerMetrics()
    first.finals_total.inc()
    first.error_sent("malformed")
    assert first.value("qasr_finals_total") == 1 and second.value("qasr_finals_total") == 0
    assert second.value("qasr_errors_total", code="malformed") is None


def test_every_family_has_help_the_engine_stats_included():
    metrics = ServerMetrics()
    engine = StubEngine({
        "queue": {"final": 1, "partial": 3}, "running": 4, "steps": 120, "batch_sizes": [1, 2, 6],
        "seconds": {"admit": 0.5, "idle": 2.0}, "process_cpu_seconds": 1.25, "some new-key": 7,
        "not a number": "text", "empty": [], "flag": True,
    })
    text = metrics.render(engine)
    shown = families(text)
    for name, family in shown.items():
        assert family.documentation, f"{name} has no HELP line"
    engine_families = {name for name in shown if name.startswith("qasr_engine_")}
    assert {"qasr_engine_ready", "qasr_engine_queue", "qasr_engine_running", "qasr_engine_steps",
            "qasr_engine_batch_sizes_last", "qasr_engine_batch_sizes_mean", "qasr_engine_batch_sizes_max",
            "qasr_engine_seconds", "qasr_engine_process_cpu_seconds", "qasr_engine_some_new_key"} <= engine_families
    assert not {"qasr_engine_not_a_number", "qasr_engine_empty", "qasr_engine_flag"} & engine_families
    assert "`some new-key`" in shown["qasr_engine_some_new_key"].documentation  # unknown keys: a generic HELP
    assert sample(text, "qasr_engine_ready") == 1
    assert sample(text, "qasr_engine_queue", kind="partial") == 3
    assert sample(text, "qasr_engine_seconds", kind="admit") == 0.5
    assert sample(text, "qasr_engine_batch_sizes_last") == 6 and sample(text, "qasr_engine_batch_sizes_max") == 6
    assert sample(text, "qasr_engine_batch_sizes_mean") == 3
    assert shown["qasr_engine_running"].type == "gauge"


def test_an_engine_whose_stats_fail_still_shows_its_readiness():
    metrics = ServerMetrics()
    text = metrics.render(StubEngine(RuntimeError("stopping"), ready=False))
    assert sample(text, "qasr_engine_ready") == 0
    from_stats = [name for name in families(text) if name.startswith("qasr_engine_")
                  and name not in ("qasr_engine_ready", "qasr_engine_stage_seconds")]  # the latter is the server's
    assert not from_stats
    assert "qasr_engine_ready" not in metrics.render()  # no engine: no engine families


def test_a_scrape_counts_the_event_loops_tasks():
    """qasr_event_loop_tasks (what bench/soak.py watches for leaks): the tasks alive when /metrics is rendered."""
    import asyncio

    async def main():
        metrics = ServerMetrics()
        alone = sample(metrics.render(), "qasr_event_loop_tasks")
        parked = [asyncio.create_task(asyncio.sleep(60)) for _ in range(3)]
        with_three = sample(metrics.render(), "qasr_event_loop_tasks")
        for task in parked:
            task.cancel()
        await asyncio.gather(*parked, return_exceptions=True)
        return alone, with_three, sample(metrics.render(), "qasr_event_loop_tasks")

    alone, with_three, after = asyncio.run(main())
    assert alone == 1 and with_three == 4 and after == 1  # main() itself, then three more, then none of them
