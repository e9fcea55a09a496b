"""The server's lifecycle (issue #14): a SIGTERM while the model loads, HTTP during the drain, the warm-up before
/readyz says ready, slow readers beside normal streams, and a SIGTERM under load on the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from qasr.client.errors import ServiceUnavailable
from qasr.client.stream import StreamClient
from qasr.server.app import WARM_UP_STREAM, QasrServer, ServerConfig
from qasr.server.limits import ServerLimits
from qasr.server.protocol import NativeProtocol

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine, speech_like, to_s16le
from test_app import TWO_BURSTS, decode, finals, http_get, receive_all, run, running, stream, until, url
from live_server import free_port, real_engine, serving

START = json.dumps({"type": "start", "partials": False})


# -- SIGTERM while the model loads ---------------------------------------------------------------------------------

def test_sigterm_while_the_model_loads_ends_the_server_and_its_engine_process_at_once(tmp_path):
    """The engine process downloads the model from a Hugging Face endpoint that never answers (a load that takes
    minutes); SIGTERM must end the server and that process within seconds, exit code 0."""
    with socket.socket() as black_hole:  # accepts connections, never answers
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen()
        port = free_port()
        env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{black_hole.getsockname()[1]}",
               "HF_HOME": str(tmp_path / "hf"), "HF_HUB_ETAG_TIMEOUT": "600", "HF_HUB_DOWNLOAD_TIMEOUT": "600"}
        env.pop("HF_HUB_OFFLINE", None)
        server = subprocess.Popen([sys.executable, "-m", "qasr.server.cli", "--model", "Qwen/Qwen3-ASR-0.6B",
                                   "--device", "cpu", "--port", str(port)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            black_hole.settimeout(120)
            downloading, _ = black_hole.accept()  # the engine process is loading (its signals are set by now)
            child_pids = [int(pid) for children in Path(f"/proc/{server.pid}/task").glob("*/children")
                          for pid in children.read_text().split()]
            engine_pid = next((pid for pid in child_pids if b"spawn_main" in _cmdline(pid)), None)
            health = asyncio.run(_get(port, "/healthz")), asyncio.run(_get(port, "/readyz"))
            server.send_signal(signal.SIGTERM)
            began = time.monotonic()
            exit_code = server.wait(20)
            took_s = time.monotonic() - began
            downloading.close()
        finally:
            server.kill()
            output = server.communicate()[0].decode()
    assert health == (200, 503), output
    assert exit_code == 0 and took_s < 10, (took_s, output)
    # the engine process (and multiprocessing's resource tracker, which follows its parent out)
    deadline = time.monotonic() + 5
    while [pid for pid in child_pids if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_pid in child_pids and not [pid for pid in child_pids if _alive(pid)], output


async def _get(port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    status_line = await reader.readline()
    writer.close()
    return int(status_line.split()[1])


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_stop_during_the_load_returns_at_once_and_closes_an_engine_that_arrives_later():
    release = threading.Event()
    engine = FakeEngine()

    def slow_factory():
        release.wait(10)
        return engine

    async def main():
        server = QasrServer(None, ServerConfig(port=0, ping_interval_s=None))
        await server.start()
        loading = asyncio.ensure_future(server.load_engine(slow_factory))
        await asyncio.sleep(0.05)
        began = time.monotonic()
        await server.stop()
        stopped_in = time.monotonic() - began
        await loading  # returns: the load was abandoned
        return stopped_in, server

    stopped_in, server = run(main())
    assert stopped_in < 1 and server.engine is None
    release.set()  # the load finishes after the server stopped: its thread closes the engine
    deadline = time.monotonic() + 5
    while not engine.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.closed


# -- HTTP during the drain -----------------------------------------------------------------------------------------

def test_during_the_drain_healthz_is_200_readyz_503_and_new_upgrades_get_503():
    async def main():
        engine = FakeEngine(manual=True)  # the open segment's final waits until the test answers it
        server = QasrServer(engine, ServerConfig(port=0, ping_interval_s=None))
        await server.start()
        audio, _ = speech_like([("silence", 0.3), ("speech", 1.0)])
        websocket = await connect(url(server))
        await websocket.send(START)
        await websocket.send(to_s16le(audio))
        await websocket.recv(), await websocket.recv()  # ready, speech_started
        stopping = asyncio.ensure_future(server.stop())
        await engine.wait_for_calls(1)  # the drain asked for the open segment's final
        during = [(await http_get(server, path))[0] for path in ("/healthz", "/readyz")]
        with pytest.raises(InvalidStatus) as refused:
            await connect(url(server))
        engine.complete(engine.pending()[0], "the last words")
        rest = await receive_all(websocket)
        await stopping
        with pytest.raises(OSError):  # the port closes last
            await connect(url(server), open_timeout=1)
        return during, refused.value.response, rest, websocket.close_code

    during, refused, rest, code = run(main())
    assert during == [200, 503]
    assert refused.status_code == 503 and b"shutting down" in refused.body
    assert [event["type"] for event in rest] == ["error", "final", "summary"] and code == 1001
    assert rest[1]["text"] == "the last words"


# -- warm-up ----------------------------------------------------------------------------------------------------

def test_readyz_says_ready_only_after_a_warm_up_decode():
    async def main():
        engine = FakeEngine(manual=True, ready=False)
        server = QasrServer(None, ServerConfig(port=0, ping_interval_s=None))
        await server.start()
        loading = asyncio.ensure_future(server.load_engine(lambda: engine))
        await engine.wait_for_calls(1)
        (call,) = engine.pending()
        before = (await http_get(server, "/readyz"))[0]
        with pytest.raises(InvalidStatus) as refused:
            await connect(url(server))
        engine.complete(call)
        await loading
        after = (await http_get(server, "/readyz"))[0]
        out, code = await stream(server, b"", start={"partials": False})  # streams are served now
        await server.stop()
        return call.request, before, refused.value.response.status_code, after, code, engine

    request, before, refused, after, code, engine = run(main())
    assert request.stream_id == WARM_UP_STREAM and len(request.audio) == 16000
    assert (before, refused, after, code) == (503, 503, 200, 1000)
    assert WARM_UP_STREAM in engine.released


def test_qasr_client_reads_a_503_handshake_as_retryable_service_unavailable():
    async def main():
        async with running(FakeEngine(ready=False)) as server:
            with pytest.raises(ServiceUnavailable) as refused:
                await StreamClient(url(server)).connect()
            return refused.value

    error = run(main())
    assert error.status == 503 and error.retryable and "still loading" in error.message


def test_an_engine_that_fails_its_warm_up_fails_the_load():
    async def main():
        engine = FakeEngine(manual=True, ready=False)
        server = QasrServer(None, ServerConfig(port=0, ping_interval_s=None))
        await server.start()
        loading = asyncio.ensure_future(server.load_engine(lambda: engine))
        await engine.wait_for_calls(1)
        engine.fail(engine.pending()[0], RuntimeError("CUDA error"))
        with pytest.raises(RuntimeError, match="warm-up decode: RuntimeError: CUDA error"):
            await loading
        ready = server.is_ready()
        await server.stop()
        return ready

    assert run(main()) is False


# -- slow readers ------------------------------------------------------------------------------------------------

def test_a_client_that_stops_reading_is_held_back_then_dropped_while_another_stream_carries_on(monkeypatch):
    """The slow client sends flushes whose unknown field (8 KB) each earn an error event, and never reads. The
    server must stop reading its messages once its frames back up (bounded memory), serve the normal stream
    beside it, and drop it after send_timeout_s although keepalive pings are on (they cannot get through)."""
    received: dict[int, int] = {}  # adapter -> messages the server read from its client
    original_receive = NativeProtocol.receive

    def counting_receive(self, message):
        received[id(self)] = received.get(id(self), 0) + 1
        return original_receive(self, message)

    monkeypatch.setattr(NativeProtocol, "receive", counting_receive)
    flood = json.dumps({"type": "flush", "x" * 8192: 1})
    num_flood = 2000  # ~16 MB of error events if the server made them all

    async def main():
        engine = FakeEngine(delay_s=0.005)
        config = ServerConfig(port=0, ping_interval_s=0.5, limits=ServerLimits(send_timeout_s=1.5))
        server = QasrServer(engine, config)
        await server.start()
        slow = await connect(url(server), ping_interval=None, max_size=None)
        await slow.send(START)
        await slow.recv()  # ready
        (connection,) = server.connections
        connection.websocket.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                                           16384)
        slow.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        slow.transport.pause_reading()  # stops reading; its TCP stack stays up

        async def send_flood():
            for _ in range(num_flood):
                await slow.send(flood)

        flooding = asyncio.ensure_future(send_flood())
        audio, _ = speech_like(TWO_BURSTS)
        normal_out, normal_code = await stream(server, to_s16le(audio), start={"partials": False})
        await until(lambda: connection not in server.connections, timeout=10)  # dropped after send_timeout_s
        flooding.cancel()
        slow.transport.abort()
        await server.stop()
        return normal_out, normal_code, received, server, engine

    normal_out, normal_code, received, server, engine = run(main())
    assert normal_code == 1000 and len(finals(normal_out)) == 2 and normal_out[-1]["type"] == "summary"
    slow_read = max(received.values())
    assert slow_read < num_flood // 10, f"the server read {slow_read} of a non-reading client's messages"
    assert server.metrics.sessions_active == 0 and not engine.streams


# -- SIGTERM under load ------------------------------------------------------------------------------------------

def test_sigterm_under_load_gives_every_stream_all_its_finals_before_1001(tiny_model_dir):
    """Several streams on the tiny model, in real time; stop() (the SIGTERM path) while each has a segment closed
    and one open: every segment a stream heard gets exactly one final, then the summary, then 1001."""
    num_streams = 4
    pattern = [("silence", 0.3), ("speech", 0.8), ("silence", 0.7), ("speech", 2.5)]
    audio, _ = speech_like(pattern)
    chunk = 1600  # 100 ms

    async def one_stream(server, out: list[dict]):
        websocket = await connect(url(server))
        await websocket.send(START)

        async def read():
            async for message in websocket:
                out.append(decode(message))

        reading = asyncio.ensure_future(read())
        try:
            for offset in range(0, len(audio), chunk):
                await websocket.send(to_s16le(audio[offset:offset + chunk]))
                await asyncio.sleep(0.1)
        except ConnectionClosed:  # the drain stopped reading and closed
            pass
        await asyncio.wait({reading})
        return websocket.close_code

    def hears_its_second_segment(out: list[dict]) -> bool:
        return any(event["type"] == "speech_started" and event["segment_id"] == 1 for event in out)

    async def main():
        engine = real_engine(tiny_model_dir)
        outs = [[] for _ in range(num_streams)]
        async with serving(engine, drain_timeout_s=60) as server:
            streams = [asyncio.ensure_future(one_stream(server, out)) for out in outs]
            await until(lambda: all(hears_its_second_segment(out) for out in outs), timeout=60)
            await server.stop()  # what SIGTERM calls
            codes = await asyncio.gather(*streams)
        return list(zip(outs, codes))

    results = asyncio.run(asyncio.wait_for(main(), 120))
    for out, code in results:
        kinds = [event["type"] for event in out]
        started = [event["segment_id"] for event in out if event["type"] == "speech_started"]
        final_ids = [event["segment_id"] for event in finals(out)]
        assert code == 1001, kinds
        assert len(started) == 2 and final_ids == started, kinds  # the closed and the open segment
        assert kinds[-1] == "summary" and out[-1]["segments"] == 2
        assert {"code": "going_away"}.items() <= next(e for e in out if e["type"] == "error").items()
