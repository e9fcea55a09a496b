"""bench/soak.py's verdict: the issue's pass criteria (#14), each of which alone fails the run."""

from __future__ import annotations

import dataclasses

import pytest
from websockets.datastructures import Headers
from websockets.exceptions import InvalidStatus
from websockets.http11 import Response

from qasr.bench.soak import Report, problem_of, verdict

PASSING = Report(streams=10, minutes=1, stream_seconds=10, completed=30, segments=90, finals=90, rss_growth_pct=1.2,
                 fds_growth=0, tasks_growth=0)


def test_a_run_that_meets_every_criterion_passes():
    assert verdict(PASSING) == {"no_failed_streams": True, "one_final_per_segment": True,
                                "rss_growth_under_5pct": True, "no_fd_growth": True, "no_task_growth": True}


@pytest.mark.parametrize("change, criterion", [
    (dict(failed=1), "no_failed_streams"),
    (dict(missing_finals=1), "one_final_per_segment"),
    (dict(duplicate_finals=1), "one_final_per_segment"),
    (dict(rss_growth_pct=5.0), "rss_growth_under_5pct"),
    (dict(rss_growth_pct=None), "rss_growth_under_5pct"),  # too short to measure after the warm-up
    (dict(fds_growth=1), "no_fd_growth"),
    (dict(tasks_growth=2), "no_task_growth"),
    (dict(tasks_growth=None), "no_task_growth"),  # a server whose /metrics has no task count
])
def test_each_criterion_alone_fails_the_run(change, criterion):
    result = verdict(dataclasses.replace(PASSING, **change))
    assert [name for name, held in result.items() if not held] == [criterion]


def test_a_refused_handshake_is_counted_with_its_status():
    refused = InvalidStatus(Response(503, "Service Unavailable", Headers()))
    assert problem_of(refused) == "InvalidStatus 503" and problem_of(TimeoutError()) == "TimeoutError"
