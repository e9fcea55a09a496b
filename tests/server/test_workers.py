"""`qasr-server --workers 2 --devices cpu,cpu` on the tiny model (CPU, two real engine processes): streams spread over
both front-end workers and both engines and each gets its finals; /metrics from either worker sums both workers and
shows each engine's stats under its `engine` label; a killed worker is restarted while the other serves; a killed
engine process costs the streams placed on it one segment (`decode_failed`, an empty final) while the other engine
serves on, and comes back; SIGTERM drains both workers with every final delivered, stops everything and exits 0
without an abort in torch's teardown. The tests run in order on one server (it takes a while to start on a loaded
CPU); the last one stops it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from fakes import speech_like, to_s16le  # tests/ is on sys.path (conftest)
from live_server import free_port

SEGMENT = [("speech", 1.0), ("silence", 1.0)]  # one segment, closed by the silence after it


def running(pid) -> bool:
    """Alive and not a zombie (an exited child no one reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class Replica:
    def __init__(self, model_dir: Path):
        self.port = free_port()
        # every final decodes 150 tokens (EOS ignored): the engine is still busy with them when it is killed
        self.process = subprocess.Popen(
            [sys.executable, "-m", "qasr.server.cli", "--model", str(model_dir), "--device", "cpu", "--port",
             str(self.port), "--workers", "2", "--devices", "cpu,cpu", "--slots", "8", "--retained-slots", "0", "--max-len", "1024",
             "--ignore-eos", "--base-tokens", "150", "--tokens-per-second", "0", "--admission-target-ms", "0",
             "--log-level", "info"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
        except OSError:
            return 0, ""

    def metric(self, name: str, engine: str | None = None) -> float:
        """The sum of the metric's series (an engine's carry an `engine` label); `engine`: that engine's only."""
        status, text = self.get("/metrics")
        assert status == 200, (status, text)
        series = [line.split(" ")[0] for line in text.splitlines()]
        return sum(float(line.split()[-1]) for line, key in zip(text.splitlines(), series)
                   if (key == name or key.startswith(name + "{"))
                   and (engine is None or f'engine="{engine}"' in key))

    def children(self) -> set[int]:
        return {int(pid) for children in Path(f"/proc/{self.process.pid}/task").glob("*/children")
                for pid in children.read_text().split() if running(pid)}

    def engine_pids(self, worker_pids: set[int]) -> list[int]:
        """The supervisor's children that are neither workers nor multiprocessing's resource tracker."""
        others = [pid for pid in self.children() - worker_pids
                  if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(others) == 2, others
        return others


def until(condition, timeout_s: float = 240.0, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval_s)


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    replica = Replica(tiny_model_dir)
    try:
        try:  # three processes load on a CPU the other tests share: it can take minutes
            until(lambda: replica.get("/readyz")[0] == 200 or replica.process.poll() is not None, 900)
        except AssertionError:
            replica.process.send_signal(signal.SIGTERM)
            raise AssertionError("the replica did not get ready:\n" + replica.process.communicate(timeout=60)[0].decode())
        assert replica.process.poll() is None, replica.process.communicate()[0].decode()
        yield replica
    finally:
        if replica.process.poll() is None:
            replica.process.kill()
        if not hasattr(replica, "output"):  # the SIGTERM test read it
            replica.output = replica.process.communicate()[0].decode()


async def open_stream(port: int):
    """A started native stream -> (websocket, the worker that took it: (index, pid))."""
    websocket = await connect(f"ws://127.0.0.1:{port}/v1/stream")
    index, pid = websocket.response.headers["X-Qasr-Worker"].split("/")
    await websocket.send(json.dumps({"type": "start", "partials": False}))
    assert json.loads(await websocket.recv())["type"] == "ready"
    return websocket, (int(index), int(pid))


async def events_until_closed(websocket) -> list[dict]:
    return [json.loads(message) async for message in websocket]


async def streams_on_both_workers(port: int, count: int = 4, limit: int = 40):
    """Open streams until `count` are open and both workers hold at least one (the kernel spreads connections by a
    hash of the client's address and port: a few attempts find both); the others are closed."""
    opened = []
    for _ in range(limit):
        opened.append(await open_stream(port))
        if len(opened) >= count and {worker for _, (worker, _) in opened} == {0, 1}:
            break
    assert {worker for _, (worker, _) in opened} == {0, 1}, "every stream went to one worker"
    kept = [next(stream for stream in opened if stream[1][0] == worker) for worker in (0, 1)]
    kept += [stream for stream in opened if stream not in kept][:count - 2]
    for stream in opened:
        if stream not in kept:
            await stream[0].close()
    return kept


def test_streams_spread_over_both_workers_and_both_engines_each_gets_its_finals_and_metrics_sum_both(replica):
    async def main():
        streams = await streams_on_both_workers(replica.port)
        for seed, (websocket, _) in enumerate(streams):
            await websocket.send(to_s16le(speech_like(SEGMENT * 2, seed=seed)[0]))
            await websocket.send(json.dumps({"type": "end"}))
        return [(worker, await events_until_closed(websocket), websocket.close_code)
                for websocket, worker in streams]

    before = replica.metric("qasr_finals_total")
    steps_before = [replica.metric("qasr_engine_steps", engine) for engine in ("0", "1")]
    results = asyncio.run(asyncio.wait_for(main(), 300))
    assert {pid for (_, pid), _, _ in results} <= replica.children() and len({w for w, _, _ in results}) == 2
    for worker, events, close_code in results:
        kinds = [event["type"] for event in events]
        assert close_code == 1000 and kinds.count("final") == 2 and kinds[-1] == "summary", (worker, kinds)
    # either worker answers /metrics with the sum of both: ask a few times (each request lands on one of them)
    assert all(replica.metric("qasr_finals_total") - before == 2 * len(results) for _ in range(6))
    assert replica.metric("qasr_sessions_active") == 0 and replica.metric("qasr_worker_cpu_seconds") > 0
    # each engine worked (the segments arrive together: a worker places them on both), its stats under its label
    assert all(replica.metric("qasr_engine_steps", engine) > before for engine, before in zip("01", steps_before))


def test_a_killed_worker_is_restarted_while_the_other_serves(replica):
    async def main():
        streams = await streams_on_both_workers(replica.port, count=2)
        victim = next(worker for _, worker in streams if worker[0] == 0)
        survivor = next(websocket for websocket, worker in streams if worker[0] == 1)
        os.kill(victim[1], signal.SIGKILL)
        await asyncio.sleep(0.5)
        await survivor.send(to_s16le(speech_like(SEGMENT, seed=7)[0]))  # the other worker serves on
        await survivor.send(json.dumps({"type": "end"}))
        events = await events_until_closed(survivor)
        return victim, events

    victim, events = asyncio.run(asyncio.wait_for(main(), 300))
    assert [event["type"] for event in events].count("final") == 1
    assert victim[1] not in replica.children()
    until(lambda: replica.get("/readyz")[0] == 200)  # the replacement is up: both workers serve again

    async def worker_zero():
        streams = await streams_on_both_workers(replica.port, count=2)
        for websocket, _ in streams:
            await websocket.close()
        return next(pid for _, (index, pid) in streams if index == 0)

    assert asyncio.run(worker_zero()) not in (victim[1], None)


def test_a_killed_engine_process_costs_its_streams_one_segment_while_the_other_serves_and_comes_back(replica):
    async def main():
        streams = await streams_on_both_workers(replica.port, count=4)
        for seed, (websocket, _) in enumerate(streams):
            await websocket.send(to_s16le(speech_like(SEGMENT, seed=seed)[0]))
        both_busy = lambda: all(replica.metric("qasr_engine_running", engine) >= 1 for engine in "01")  # noqa: E731
        await asyncio.to_thread(until, both_busy, 120, 0.05)
        os.kill(replica.engine_pids({pid for _, (_, pid) in streams})[0], signal.SIGKILL)
        await asyncio.sleep(0.5)
        during = replica.get("/readyz")[0], replica.get("/healthz")[0]  # a degraded pool serves on the other
        await asyncio.to_thread(until, lambda: replica.metric("qasr_engine_restarts_total") == 1
                                and replica.metric("qasr_engine_serving") == 2, 240)
        for seed, (websocket, _) in enumerate(streams):  # the next segment decodes on either engine
            await websocket.send(to_s16le(speech_like(SEGMENT, seed=10 + seed)[0]))
            await websocket.send(json.dumps({"type": "end"}))
        return during, [await events_until_closed(websocket) for websocket, _ in streams]

    during, results = asyncio.run(asyncio.wait_for(main(), 400))
    assert during == (200, 200)
    failed = 0
    for events in results:
        shown = [(event["type"], event.get("code")) for event in events]
        finals = [event for event in events if event["type"] == "final"]
        assert len(finals) == 2 and finals[1]["text"] != "", shown
        if ("error", "decode_failed") in shown:  # its segment was on the killed engine
            failed += 1
            assert finals[0]["text"] == "", shown
        else:  # on the other engine: untouched
            assert finals[0]["text"] != "", shown
    assert 1 <= failed < len(results)
    assert replica.metric("qasr_engine_restarts_total") == 1


def test_sigterm_drains_both_workers_with_every_final_and_stops_everything(replica):
    async def main():
        streams = await streams_on_both_workers(replica.port, count=2)
        for seed, (websocket, _) in enumerate(streams):
            await websocket.send(to_s16le(speech_like(SEGMENT, seed=20 + seed)[0]))
        await asyncio.to_thread(until, lambda: replica.metric("qasr_engine_running") >= 1, 120, 0.05)
        children = replica.children()
        replica.process.send_signal(signal.SIGTERM)
        return children, [await events_until_closed(websocket) for websocket, _ in streams], \
            [websocket.close_code for websocket, _ in streams]

    children, results, close_codes = asyncio.run(asyncio.wait_for(main(), 300))
    replica.output = replica.process.communicate(timeout=120)[0].decode()
    assert replica.process.returncode == 0, replica.output
    assert "terminate called" not in replica.output  # no thread died inside torch during the interpreter's exit
    assert close_codes == [1001, 1001]
    for events in results:
        finals = [event for event in events if event["type"] == "final"]
        assert len(finals) == 1 and finals[0]["text"] != "", events  # drained: decoded, not dropped
    until(lambda: not any(running(str(pid)) for pid in children), 20)
