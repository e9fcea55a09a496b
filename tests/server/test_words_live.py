"""Word times end to end (#17): `qasr-server --aligner` (its own process, the engine in a process of its own, the tiny
model and a tiny random aligner on the CPU: conftest.aligner_server_port) and native-protocol clients over real
sockets. A stream that asks gets finals whose words lie inside the segment in stream time, in order; a stream that
does not ask gets finals without `words`; partials never carry them."""

from __future__ import annotations

import asyncio
import contextlib
import json

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from fakes import speech_like, to_s16le  # tests/ is on sys.path (conftest)
from qasr.model.aligner_words import split_words

BURSTS = [("silence", 0.4), ("speech", 1.4), ("silence", 0.9), ("speech", 1.1), ("silence", 0.9), ("speech", 0.8),
          ("silence", 0.8)]
SR = 16000


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


def test_finals_of_a_stream_that_asked_carry_words_inside_the_segment_in_order(aligner_server_port):
    events = asyncio.run(stream(aligner_server_port, {"words": True}))
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


def test_a_stream_that_did_not_ask_gets_finals_without_words(aligner_server_port):
    events = asyncio.run(stream(aligner_server_port, {}))
    finals = [e for e in events if e["type"] == "final"]
    assert len(finals) == 3 and not any("words" in f or "words_reason" in f for f in finals)
