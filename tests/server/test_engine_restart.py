"""A live server (real sockets, the tiny model on the CPU in a real engine process) whose engine process is killed
mid-stream (#14 faults): the stream stays open, the segment the dead process held gets an empty final after a
`decode_failed` error, the next segment decodes, /readyz is 503 while the engine restarts (/healthz 200) and 200
after, /metrics counts the restart. Past the restart budget /healthz says 500 and a stream that needs the engine
closes with 1011."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError

from fakes import speech_like, to_s16le  # tests/ is on sys.path (conftest)
from live_server import serving, stream_url
from qasr.engine.engine_process import EngineProcess
from qasr.engine.options import EngineOptions

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
