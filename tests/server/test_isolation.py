"""Isolation across streams and keys (#14 security): nothing of one stream reaches another.

A live server on the tiny model (real engine, CPU) with three API keys from a key file, each allowed exactly four
streams. Twelve streams (four per key) send different speech-like audio at once, partials on, so their segments share
the engine's batches and its stream cache (encoder windows, retained KV prefixes, last answers) holds several streams
at a time. Each stream's finals must be exactly what the same audio gives when it is streamed alone (finals are
decoded from the segment's audio alone, so the text is a function of that audio and of nothing else), and once every
stream has ended the engine's stream cache is empty again.

Random weights hear a segment's length far more than its sounds: two different segments of the same number of audio
tokens came out as one text. So every segment here has a length no other has (0.12 s apart, more than a token's 77
ms), and the test checks that all 24 texts differ: a final delivered to the wrong stream cannot pass for its own.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
from websockets.asyncio.client import connect

from fakes import speech_like, to_s16le  # tests/ is on sys.path (conftest)
from live_server import serving, stream_url
from qasr.engine.engine import AsyncEngine, Engine
from qasr.engine.options import EngineOptions
from qasr.server.auth import Authenticator, KeyStore, hash_key
from qasr.server.security import SecuritySettings

KEYS = {"alpha": "isolation-key-alpha-0001", "beta": "isolation-key-beta-00002", "gamma": "isolation-key-gamma-0003"}
STREAMS_PER_KEY = 4
NUM_STREAMS = STREAMS_PER_KEY * len(KEYS)
# a small decode budget: random weights rarely stop by themselves, and a score of tokens differs with the audio
OPTIONS = EngineOptions(num_slots=8, max_len=1024, num_retained=8, base_tokens=16, tokens_per_second=4)
FRAME_SAMPLES = 1600  # 100 ms of 16 kHz audio per message
FRAME_PAUSE_S = 0.025  # four times real time: the streams overlap for several seconds


def audio_of(stream: int) -> np.ndarray:
    """Two utterances no other stream has: a voice of its own (seed) and lengths of its own."""
    first, second = 0.8 + 0.12 * stream, 0.8 + 0.12 * (NUM_STREAMS + stream)
    pattern = [("silence", 0.3), ("speech", first), ("silence", 1.0), ("speech", second), ("silence", 1.0)]
    return speech_like(pattern, seed=100 * stream)[0]


def keys_file(path) -> SecuritySettings:
    path.write_text("".join(f"{hash_key(key)} name={name} max_streams={STREAMS_PER_KEY}\n"
                            for name, key in KEYS.items()))
    return SecuritySettings(auth=Authenticator(KeyStore.load(path), required=True))


async def stream(port: int, key: str, audio: np.ndarray, pause_s: float = FRAME_PAUSE_S) -> list[dict]:
    """The audio in 100 ms frames, `pause_s` apart, then end; -> every event (ready first) until the server closes
    the stream."""
    pcm = to_s16le(audio)
    async with connect(stream_url(port), additional_headers={"Authorization": f"Bearer {key}"}) as websocket:
        await websocket.send(json.dumps({"type": "start", "sample_rate": 16000}))
        ready = json.loads(await websocket.recv())
        assert ready["type"] == "ready", ready
        events: list[dict] = [ready]

        async def read() -> None:
            async for message in websocket:
                events.append(json.loads(message))

        reader = asyncio.create_task(read())
        for offset in range(0, len(pcm), 2 * FRAME_SAMPLES):
            await websocket.send(pcm[offset:offset + 2 * FRAME_SAMPLES])
            await asyncio.sleep(pause_s)
        await websocket.send(json.dumps({"type": "end"}))
        await reader
        assert websocket.close_code == 1000, events
        return events


def finals(events: list[dict]) -> list[tuple]:
    return [(e["segment_id"], e["start"], e["end"], e["language"], e["text"]) for e in events if e["type"] == "final"]


def test_concurrent_streams_of_several_keys_each_get_exactly_their_own_finals_and_free_their_caches(
        tiny_model_dir, tmp_path):
    audios = [audio_of(stream) for stream in range(NUM_STREAMS)]
    keys = [KEYS[name] for name in KEYS for _ in range(STREAMS_PER_KEY)]

    async def main():
        engine = AsyncEngine(await asyncio.to_thread(Engine.from_pretrained, str(tiny_model_dir), device="cpu",
                                                     dtype="float32", options=OPTIONS))
        async with serving(engine, security=keys_file(tmp_path / "keys")) as server:
            # alone, one after another: nothing to overlap with, so as fast as the server takes the audio
            alone = [await stream(server.port, key, audio, pause_s=0) for key, audio in zip(keys, audios)]
            cached_alone = await released(engine)
            cached = []

            async def watch_the_cache() -> None:
                while True:
                    cached.append(engine.stats()["streams_cached"])
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch_the_cache())
            together = await asyncio.gather(*(stream(server.port, key, audio) for key, audio in zip(keys, audios)))
            watcher.cancel()
            cached_after = await released(engine)
            stats = engine.stats()
        return alone, together, cached_alone, max(cached), cached_after, stats

    alone, together, cached_alone, most_cached, cached_after, stats = asyncio.run(asyncio.wait_for(main(), 600))
    reference = [finals(events) for events in alone]
    assert all(len(segments) == 2 for segments in reference), reference  # each sentence is a segment
    texts = [text for segments in reference for *_, text in segments]
    assert len(set(texts)) == len(texts), texts  # every segment's text differs: none could pass for another's
    for index, events in enumerate(together):
        assert finals(events) == reference[index], index  # the same segments, times and texts as alone
        summary = events[-1]
        assert summary["type"] == "summary" and summary["segments"] == 2, events
    session_ids = {events[0]["session_id"] for events in together}
    assert len(session_ids) == len(together)
    assert most_cached > 1  # the stream cache held several streams at once
    assert cached_alone == 0 and cached_after == 0
    assert stats["free_slots"] == OPTIONS.num_slots and stats["running"] == 0


async def released(engine: AsyncEngine, timeout_s: float = 10.0) -> int:
    """The engine's cached streams once it has applied the releases of streams that ended (at its next step)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while engine.stats()["streams_cached"] and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return engine.stats()["streams_cached"]
