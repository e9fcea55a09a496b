"""Word times end to end (#17): `qasr-server --aligner` (its own process, the engine in a process of its own, the tiny
model and a tiny random aligner on the CPU) and native-protocol clients over real sockets. A stream that asks gets
finals whose words lie inside the segment in stream time, in order; a stream that does not ask gets finals without
`words`; partials never carry them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from fakes import speech_like, to_s16le  # tests/ is on sys.path (conftest)
from qasr.model.aligner_words import split_words

BURSTS = [("silence", 0.4), ("speech", 1.4), ("silence", 0.9), ("speech", 1.1), ("silence", 0.9), ("speech", 0.8),
          ("silence", 0.8)]
SR = 16000


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server_port(tiny_model_dir, tiny_aligner_dir):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "qasr.server.cli", "--model", str(tiny_model_dir),
                               "--aligner", str(tiny_aligner_dir), "--device", "cpu", "--port", str(port),
                               "--slots", "4", "--max-segment-s", "10"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not _ready(port):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail("qasr-server --aligner did not become ready:\n" + server.communicate()[0].decode())
            time.sleep(0.5)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


async def stream(port: int, start: dict) -> list[dict]:
    audio, _ = speech_like(BURSTS, seed=3)
    data = to_s16le(audio)
    events = []
    async with connect(f"ws://127.0.0.1:{port}/v1/stream") as websocket:
        await websocket.send(json.dumps({"type": "start", "language": "English", "partial_interval_ms": 500,
                                         **start}))

        async def receive():
            with contextlib.suppress(ConnectionClosed):
                async for message in websocket:
                    events.append(json.loads(message))

        receiving = asyncio.ensure_future(receive())
        step = 2 * SR // 10
        for offset in range(0, len(data), step):
            await websocket.send(data[offset:offset + step])
            await asyncio.sleep(0.02)
        await websocket.send(json.dumps({"type": "end"}))
        await asyncio.wait_for(receiving, 180)
    return events


def test_finals_of_a_stream_that_asked_carry_words_inside_the_segment_in_order(server_port):
    events = asyncio.run(stream(server_port, {"words": True}))
    ready = events[0]
    assert ready["type"] == "ready" and ready["limits"]["words"] is True and ready["config"]["words"] is True
    finals = [e for e in events if e["type"] == "final"]
    assert len(finals) == 3 and finals[-1]["start"] > 2.0
    assert not any("words" in e for e in events if e["type"] == "partial")
    with_words = [f for f in finals if f["words"]]
    assert with_words, finals
    for final in finals:
        words = final["words"]
        if not words:
            assert final["words_reason"]
            continue
        assert "words_reason" not in final
        assert [w["word"] for w in words] == split_words(final["text"], "English")  # the aligner's units
        assert all(final["start"] <= w["start"] <= w["end"] <= final["end"] for w in words)
        assert all(a["start"] <= b["start"] and a["end"] <= b["end"] for a, b in zip(words, words[1:]))


def test_a_stream_that_did_not_ask_gets_finals_without_words(server_port):
    events = asyncio.run(stream(server_port, {}))
    finals = [e for e in events if e["type"] == "final"]
    assert len(finals) == 3 and not any("words" in f or "words_reason" in f for f in finals)
