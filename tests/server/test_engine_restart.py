"""A live server (real sockets, the tiny model on the CPU in a real engine process) whose engine process is killed
mid-stream (#14 faults): the stream stays open, the segment the dead process held gets an empty final after a
`decode_failed` error, the next segment decodes, /readyz is 503 while the engine restarts (/healthz 200) and 200
after, /metrics counts the restart. Past the restart budget /healthz says 500 and a stream that needs the engine
closes with 1011. The budget comes from `qasr-server --engine-max-restarts/--engine-restart-window-s` (0: a killed
engine process is not restarted). The in-process engine (--engine-in-process) is never restarted: when its thread dies
the segment it held gets its empty final just the same, /healthz says 500, and later work closes the stream."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError

from fakes import speech_like, to_s16le  # tests/ is on sys.path (conftest)
from live_server import free_port, serving, stream_url
from qasr.engine.engine import AsyncEngine, Engine
from qasr.engine.engine_process import EngineProcess
from qasr.engine.options import EngineOptions
from qasr.server import cli

# Every final decodes ~600 tokens (EOS ignored): long enough on the CPU to kill the process while it decodes one.
SLOW = EngineOptions(num_slots=4, max_len=1024, num_retained=0, ignore_eos=True, base_tokens=600,
                     tokens_per_second=0)
SEGMENT = [("speech", 1.0), ("silence", 1.0)]  # one segment, closed by the silence after it


async def engine_process(model_dir, **restarts) -> EngineProcess:
    return await asyncio.to_thread(EngineProcess, str(model_dir), device="cpu", dtype="float32", options=SLOW,
                                   **restarts)


async def http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    response = (await reader.read()).decode()  # the server closes after each response
    writer.close()
    head, _, body = response.partition("\r\n\r\n")
    return int(head.split()[1]), body


async def until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def decoding(engine: EngineProcess) -> bool:
    return engine.stats().get("running") == 1


async def restarted(port: int) -> bool:
    return (await http_get(port, "/readyz"))[0] == 200


async def not_ready(port: int) -> bool:
    return (await http_get(port, "/readyz"))[0] == 503


async def open_stream(port: int):
    websocket = await connect(stream_url(port))
    await websocket.send(json.dumps({"type": "start", "partials": False}))
    assert json.loads(await websocket.recv())["type"] == "ready"
    return websocket


async def send_segment(websocket, seed: int) -> None:
    await websocket.send(to_s16le(speech_like(SEGMENT, seed=seed)[0]))


async def received(websocket) -> list[dict]:
    """The stream's events until the server closes it, however it closes it."""
    events = []
    try:
        async for message in websocket:
            events.append(json.loads(message))
    except ConnectionClosedError:
        pass
    return events


def metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_killed_engine_process_costs_one_segment_and_the_stream_goes_on(tiny_model_dir):
    async def main():
        engine = await engine_process(tiny_model_dir)
        async with serving(engine) as server:
            port = server.port
            websocket = await open_stream(port)
            await send_segment(websocket, seed=1)
            await until(lambda: decoding(engine))  # the first segment's final is in the engine
            os.kill(engine.pid, signal.SIGKILL)
            await until(lambda: not_ready(port))
            assert (await http_get(port, "/healthz"))[0] == 200  # restarting is not a failure
            await send_segment(websocket, seed=2)  # its final waits for the new process
            await until(lambda: restarted(port))
            await websocket.send(json.dumps({"type": "end"}))
            events = [json.loads(message) async for message in websocket]
            close_code = websocket.close_code
            metrics = (await http_get(port, "/metrics"))[1]
        return events, close_code, metrics

    events, close_code, metrics = asyncio.run(asyncio.wait_for(main(), 300))
    shown = [(event["type"], event.get("code"), event.get("segment_id")) for event in events]
    assert close_code == 1000, shown
    assert sorted(shown, key=str) == sorted([("speech_started", None, 0), ("error", "decode_failed", None),
                                             ("final", None, 0), ("speech_started", None, 1), ("final", None, 1),
                                             ("summary", None, None)], key=str), shown
    assert shown.index(("error", "decode_failed", None)) + 1 == shown.index(("final", None, 0))  # just before it
    assert shown[-1][0] == "summary"
    finals = [event for event in events if event["type"] == "final"]
    assert finals[0]["text"] == "" and finals[1]["text"] != ""  # the second decoded all its ~600 tokens' text
    assert not events[1]["fatal"]
    assert metric(metrics, "qasr_engine_restarts_total") == 1
    assert "# TYPE qasr_engine_restarts_total counter" in metrics
    assert metric(metrics, 'qasr_decode_failures_total{priority="final"}') == 1


def test_past_its_restart_budget_the_engine_is_unhealthy_and_streams_that_need_it_close(tiny_model_dir):
    async def main():
        engine = await engine_process(tiny_model_dir, max_restarts=1)
        async with serving(engine) as server:
            port = server.port
            websocket = await open_stream(port)
            await send_segment(websocket, seed=1)
            await until(lambda: decoding(engine))
            os.kill(engine.pid, signal.SIGKILL)  # the one restart the budget allows
            await until(lambda: not_ready(port))
            await until(lambda: restarted(port))
            os.kill(engine.pid, signal.SIGKILL)  # one too many
            await until(lambda: unhealthy(port))
            health = await http_get(port, "/healthz")
            readiness = (await http_get(port, "/readyz"))[0]
            await send_segment(websocket, seed=2)  # needs the engine, which is gone for good
            events = await received(websocket)
            close = websocket.close_code, websocket.close_reason
            metrics = (await http_get(port, "/metrics"))[1]
        return health, readiness, events, close, metrics

    health, readiness, events, close, metrics = asyncio.run(asyncio.wait_for(main(), 300))
    assert health == (500, "engine failed: EngineClosed\n") and readiness == 503
    shown = [(event["type"], event.get("code"), event.get("segment_id")) for event in events]
    assert shown[:3] == [("speech_started", None, 0), ("error", "decode_failed", None), ("final", None, 0)], shown
    assert close == (1011, "internal"), shown  # docs/protocol.md: a server fault
    assert metric(metrics, "qasr_engine_restarts_total") == 1


async def unhealthy(port: int) -> bool:
    return (await http_get(port, "/healthz"))[0] == 500


async def stream_segment_held_by_a_dying_engine(port: int, engine_busy, kill) -> tuple[list[dict], tuple, tuple]:
    """One segment whose final the engine holds when `kill()` ends it; then /healthz and /readyz, and a second
    segment, which needs the engine. -> the stream's events, its close, (healthz, readyz)."""
    websocket = await open_stream(port)
    await send_segment(websocket, seed=1)
    await until(engine_busy)
    kill()
    await until(lambda: unhealthy(port))
    health = await http_get(port, "/healthz"), (await http_get(port, "/readyz"))[0]
    await send_segment(websocket, seed=2)
    events = await received(websocket)
    return events, (websocket.close_code, websocket.close_reason), health


def engine_pid_of(server_pid: int) -> int | None:
    children = [int(pid) for task in Path(f"/proc/{server_pid}/task").glob("*/children")
                for pid in task.read_text().split()]
    return next((pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()), None)


def test_qasr_server_with_no_restarts_allowed_leaves_a_killed_engine_process_down(tiny_model_dir):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "qasr.server.cli", "--model", str(tiny_model_dir), "--device",
                               "cpu", "--port", str(port), "--ignore-eos", "--base-tokens", "600",
                               "--tokens-per-second", "0", "--engine-max-restarts", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    async def main():
        await until(lambda: listening_and_ready(port), 240)  # /readyz 200: loaded and warmed up
        engine_pid = engine_pid_of(server.pid)
        busy = busy_in(port)
        return await stream_segment_held_by_a_dying_engine(port, busy, lambda: os.kill(engine_pid, signal.SIGKILL))

    try:
        events, close, health = asyncio.run(asyncio.wait_for(main(), 300))
        alive_after = engine_pid_of(server.pid)
        server.send_signal(signal.SIGTERM)
        exit_code = server.wait(60)
    finally:
        server.kill()
        stderr = server.communicate()[1].decode()
    assert health == ((500, "engine failed: EngineClosed\n"), 503), stderr
    assert "restart budget (0 in 300 s) is spent: not restarting it" in stderr
    assert "restarting the engine process" not in stderr and alive_after is None  # no replacement was started
    shown = [(event["type"], event.get("code"), event.get("segment_id")) for event in events]
    assert shown[:3] == [("speech_started", None, 0), ("error", "decode_failed", None), ("final", None, 0)], shown
    assert close == (1011, "internal"), shown
    assert exit_code == 0, stderr


async def listening_and_ready(port: int) -> bool:
    try:
        return await restarted(port)
    except OSError:  # not listening yet
        return False


def busy_in(port: int):
    """A condition: the server's engine is decoding one sequence (from /metrics, as seen from outside)."""
    async def busy() -> bool:
        text = (await http_get(port, "/metrics"))[1]
        return any(line.split("{")[0].split()[0] == "qasr_engine_running" and float(line.split()[-1]) >= 1
                   for line in text.splitlines() if line and not line.startswith("#"))
    return busy


@pytest.mark.parametrize("argv, message", [
    (["--engine-max-restarts", "-1"], "--engine-max-restarts must be >= 0"),
    (["--engine-restart-window-s", "0"], "--engine-restart-window-s must be > 0"),
    (["--engine-in-process", "--engine-max-restarts", "2"], "--engine-in-process never restarts its engine"),
])
def test_bad_restart_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--model", "m", *argv])
    assert caught.value.code == 2 and message in capsys.readouterr().err


def test_the_restart_flags_become_the_engine_process_budget():
    args = cli.build_parser().parse_args(["--model", "m", "--device", "cpu", "--engine-max-restarts", "5",
                                          "--engine-restart-window-s", "60"])
    build = cli.engine_factory(args)
    assert (build.keywords["max_restarts"], build.keywords["restart_window_s"]) == (5, 60.0)
    defaults = cli.engine_factory(cli.build_parser().parse_args(["--model", "m", "--device", "cpu"]))
    assert (defaults.keywords["max_restarts"], defaults.keywords["restart_window_s"]) == (3, 300.0)


def test_the_in_process_engine_when_its_thread_dies_fails_the_held_segment_and_says_unhealthy(tiny_model_dir):
    """--engine-in-process: a device error in the engine loop (as a CUDA fault raises there) ends the engine thread;
    it is not restarted. The segment it held gets its empty final after decode_failed (nothing is lost), /healthz
    says 500 and /readyz 503, a stream that needs the engine afterwards closes with 1011, and the server still stops."""
    async def main():
        engine = AsyncEngine(await asyncio.to_thread(Engine.from_pretrained, str(tiny_model_dir), device="cpu",
                                                     dtype="float32", options=SLOW))
        async with serving(engine) as server:
            def device_error():
                raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

            def break_the_loop():
                engine.engine.step = device_error  # the loop's next step raises

            async def busy() -> bool:
                return engine.stats()["running"] == 1

            outcome = await stream_segment_held_by_a_dying_engine(server.port, busy, break_the_loop)
            metrics = (await http_get(server.port, "/metrics"))[1]
        return outcome, metrics, engine

    (events, close, health), metrics, engine = asyncio.run(asyncio.wait_for(main(), 300))
    assert health == ((500, "engine failed: RuntimeError\n"), 503)
    shown = [(event["type"], event.get("code"), event.get("segment_id")) for event in events]
    assert shown[:3] == [("speech_started", None, 0), ("error", "decode_failed", None), ("final", None, 0)], shown
    assert [event["text"] for event in events if event["type"] == "final"] == [""]
    assert close == (1011, "internal"), shown
    assert metric(metrics, 'qasr_decode_failures_total{priority="final"}') == 1
    assert not engine.ready and isinstance(engine.error, RuntimeError)
