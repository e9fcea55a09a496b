"""bench/soak.py: its verdict (the issue's pass criteria, #14, each of which alone fails the run), how failures are
named, and its streams spread over client processes, merged into one report."""

from __future__ import annotations

import dataclasses
import json

import pytest
from websockets.datastructures import Headers
from websockets.exceptions import InvalidMessage, InvalidStatus
from websockets.http11 import Response

from qasr.bench.soak import Report, default_client_processes, default_warmup_s, merge_tallies, problem_of, verdict
from qasr.bench.soak import main as soak_main

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


def test_client_processes_tallies_add_up():
    report = Report(streams=4, minutes=1, stream_seconds=10, failed=1, problems={"TimeoutError": 1},
                    first_failures=[[30.0, 2, "TimeoutError"]])
    merge_tallies(report, {"completed": 5, "failed": 2, "segments": 9, "finals": 8, "missing_finals": 1,
                           "duplicate_finals": 0, "problems": {"TimeoutError": 1, "InvalidMessage (EOFError)": 1},
                           "first_failures": [[12.5, 1, "InvalidMessage (EOFError)"], [40.0, 3, "TimeoutError"]]})
    assert (report.completed, report.failed, report.segments, report.finals, report.missing_finals) == (5, 3, 9, 8, 1)
    assert report.problems == {"TimeoutError": 2, "InvalidMessage (EOFError)": 1}
    assert [failure[0] for failure in report.first_failures] == [12.5, 30.0, 40.0]  # in the order they happened


@pytest.mark.parametrize("streams, cores, processes", [(10, 2, 1), (100, 16, 1), (101, 16, 2), (200, 2, 2),
                                                       (600, 16, 6), (2000, 16, 16)])
def test_one_client_process_per_100_streams_at_most_one_per_core(streams, cores, processes):
    assert default_client_processes(streams, cores) == processes


@pytest.mark.parametrize("minutes, warmup_s", [(0.5, 30), (2, 30), (5, 60), (10, 120), (60, 120)])
def test_the_warm_up_is_a_fifth_of_the_run_within_30_to_120_s(minutes, warmup_s):
    assert default_warmup_s(minutes) == warmup_s


def test_a_refused_handshake_without_an_http_answer_names_why():
    try:
        try:
            raise EOFError("connection closed while reading HTTP status line")
        except EOFError as eof:
            raise InvalidMessage("did not receive a valid HTTP response") from eof
    except InvalidMessage as error:
        assert problem_of(error) == "InvalidMessage (EOFError)"


def test_a_soak_spread_over_client_processes_merges_their_streams_into_one_report(frontend_server, tmp_path):
    pid, port = frontend_server
    out = tmp_path / "soak.json"
    code = soak_main(["--url", f"ws://127.0.0.1:{port}/v1/stream", "--server-pid", str(pid), "--streams", "4",
                      "--client-processes", "2", "--minutes", "0.2", "--stream-seconds", "4", "--ramp-s", "1",
                      "--warmup-s", "2", "--sample-s", "1", "--final-timeout-s", "20", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["client_processes"] == 2 and len(report["completed_per_process"]) == 2
    assert all(completed >= 2 for completed in report["completed_per_process"])  # each ran its 2 streams at least once
    assert report["completed"] == sum(report["completed_per_process"])
    assert report["failed"] == 0 and report["problems"] == {}
    assert report["segments"] == report["finals"] >= report["completed"]  # 4 s of utterances hold speech
    assert report["verdict"]["no_failed_streams"] and report["verdict"]["one_final_per_segment"]
    assert code == (0 if all(report["verdict"].values()) else 1)
    assert report["samples"] and report["samples"][0]["fds"] > 0  # the server is sampled by this process
    assert report["warmup_s"] == 2 and report["idle_after_series"]  # read after the run until back to idle
