"""The server end to end with the real engine: sockets on 127.0.0.1, `AsyncEngine` on the tiny random model (CPU,
eager, fp32), speech-like audio with known pauses.

The random model's transcripts are meaningless but deterministic and differ from clip to clip, so they identify the
audio they came from: every final must equal the offline transcription (`Engine.transcribe`, same options, a fresh
engine) of exactly the samples its `start`/`end` times name. That checks the segment boundaries, that finals decode
from scratch (no partial state leaks into them), and, with many sessions at once, that each final reached the
session whose audio it transcribes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import shutil
import subprocess
import wave
from dataclasses import dataclass, field

import numpy as np
import pytest
import soxr
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from fakes import speech_like, to_s16le  # tests/ is on sys.path (conftest)
from qasr.audio import SAMPLE_RATE, decode_pcm
from qasr.model.checkpoint import load_model
from qasr.model.tokenizer import Tokenizer
from qasr.server.app import QasrServer, ServerConfig
from qasr.server.limits import ServerLimits
from qasr.engine.engine import AsyncEngine, Engine, EngineOptions
from qasr.engine.request import DecodeRequest

SR = SAMPLE_RATE
TOLERANCE_S = 0.1  # segment boundaries within 100 ms of the truth
# small and fast: the random model rarely says EOS, so the token budget (24 + 4 per second of audio) sets decode time
# (max_len 1024: each partial's text prefix is the previous partial's output, which grows fast when the random model
# never says EOS)
OPTIONS = EngineOptions(num_slots=8, max_len=1024, num_retained=16, tokens_per_second=4.0)
EXACT = {"pre_roll_ms": 0}  # segments start at the first voiced frame: comparable to the truth
ESPEAK_TEXTS = ["The quick brown fox jumps over the lazy dog.", "Please call me back tomorrow morning.",
                "Seven hundred and twelve."]


def run(coroutine, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    """Loaded once; each test builds its own engines around it (the weights are only read)."""
    return load_model(tiny_model_dir, device="cpu", dtype="float32"), Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def engine(model_and_tokenizer) -> AsyncEngine:
    model, tokenizer = model_and_tokenizer
    return AsyncEngine(Engine(model, tokenizer, OPTIONS, name="tiny"))


@pytest.fixture
def offline(model_and_tokenizer):
    """offline(clips, language) -> DecodeResults from a fresh synchronous engine with the server's options."""
    model, tokenizer = model_and_tokenizer

    def transcribe(clips: list[np.ndarray], language: str | None = None):
        engine = Engine(model, tokenizer, OPTIONS)
        return engine.transcribe([DecodeRequest(audio=clip, language=language) for clip in clips])

    return transcribe


@contextlib.asynccontextmanager
async def serving(engine: AsyncEngine, **limits):
    await engine.start()
    server = QasrServer(engine, ServerConfig(port=0, ping_interval_s=None, limits=ServerLimits(**limits)))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()  # also closes the engine


def url(server: QasrServer) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/stream"


@dataclass
class Stream:
    """What one client sent and got back."""

    samples: np.ndarray  # float32 16 kHz, exactly as the server decodes the s16le bytes
    language: str | None
    events: list[dict] = field(default_factory=list)
    close_code: int | None = None

    def finals(self) -> list[dict]:
        return [event for event in self.events if event["type"] == "final"]

    def segment_audio(self, final: dict) -> np.ndarray:
        return self.samples[round(final["start"] * SR) : round(final["end"] * SR)]


async def receive_all(websocket, events: list[dict]) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for message in websocket:
            events.append(json.loads(message))


async def stream(server: QasrServer, audio: np.ndarray, *, speed: float, start: dict | None = None,
                 chunk_s: float = 0.1, end: bool = True) -> Stream:
    """A client sending s16le in `chunk_s` pieces at `speed` x real time, then `end`; reads until the close."""
    data = to_s16le(audio)
    result = Stream(decode_pcm(data, "s16le")[:, 0], (start or {}).get("language"))
    async with connect(url(server)) as websocket:
        await websocket.send(json.dumps({"type": "start", **(start or {})}))
        receiving = asyncio.ensure_future(receive_all(websocket, result.events))
        step = 2 * round(chunk_s * SR)
        for offset in range(0, len(data), step):
            await websocket.send(data[offset : offset + step])
            await asyncio.sleep(chunk_s / speed)
        if end:
            await websocket.send(json.dumps({"type": "end"}))
        await receiving
        result.close_code = websocket.close_code
    return result


def assert_well_ordered(events: list[dict]) -> None:
    """speech_started < partials < exactly one final per segment; finals in order; summary last and counting."""
    state: dict[int, str] = {}
    for event in events:
        kind, segment = event["type"], event.get("segment_id")
        if kind == "speech_started":
            assert segment not in state
            state[segment] = "open"
        elif kind == "partial":
            assert state.get(segment) == "open", f"partial of segment {segment} in state {state.get(segment)}"
        elif kind == "final":
            assert state.get(segment) == "open", f"final of segment {segment} in state {state.get(segment)}"
            state[segment] = "final"
    finals = [event["segment_id"] for event in events if event["type"] == "final"]
    assert finals == sorted(finals) == list(range(len(state)))
    assert events[-1]["type"] == "summary" and events[-1]["segments"] == len(finals)


def assert_finals_match_truth(result: Stream, truth: list[tuple[float, float]]) -> None:
    finals = result.finals()
    assert len(finals) == len(truth), [(final["start"], final["end"]) for final in finals]
    for final, (start, end) in zip(finals, truth):
        assert abs(final["start"] - start) <= TOLERANCE_S and abs(final["end"] - end) <= TOLERANCE_S, (final, start)


def assert_finals_equal_offline(results: list[Stream], offline) -> None:
    """Every final's text and language equal the offline transcription of its own segment's samples."""
    for language in {result.language for result in results}:
        group = [(result, final) for result in results if result.language == language for final in result.finals()]
        expected = offline([result.segment_audio(final) for result, final in group], language)
        for (result, final), reference in zip(group, expected):
            assert (final["text"], final["language"]) == (reference.text, reference.language), final


def idle(stats: dict) -> bool:
    """Nothing running or queued, every slot free, no stream state kept."""
    return stats["running"] == 0 and stats["streams_cached"] == 0 and not any(stats["queue"].values()) \
        and stats["free_slots"] == OPTIONS.num_slots


async def until(condition, timeout: float = 10.0, poll_s: float = 0.01) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(poll_s)

    await asyncio.wait_for(poll(), timeout)


class TrackedEngine(AsyncEngine):
    """The real engine, counting the requests sessions are awaiting, by priority."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.awaited = collections.Counter()

    async def transcribe(self, request: DecodeRequest):
        self.awaited[request.priority.name] += 1
        try:
            return await super().transcribe(request)
        finally:
            self.awaited[request.priority.name] -= 1


# ---- speech with known pauses ----------------------------------------------------------------------------------


def espeak(text: str, folder) -> np.ndarray:
    path = folder / "utterance.wav"
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    with wave.open(str(path)) as wav:
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype=np.int16)
        rate = wav.getframerate()
    return soxr.resample(pcm.astype(np.float32) / 32768, rate, SR).astype(np.float32)


def speech_bounds(clean: np.ndarray) -> tuple[int, int]:
    """First and last 10 ms frame within 40 dB of the loudest one."""
    frame = SR // 100
    frames = clean[: len(clean) // frame * frame].reshape(-1, frame).astype(np.float64)
    energy_db = 10 * np.log10(np.mean(frames**2, axis=1) + 1e-20)
    loud = np.nonzero(energy_db > energy_db.max() - 40)[0]
    return int(loud[0]) * frame, (int(loud[-1]) + 1) * frame


@pytest.fixture(scope="module")
def espeak_stream(tmp_path_factory) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Three utterances after ~1 s pauses; the last one runs to 0.2 s before the end (too short to close it)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng); CI installs it")
    folder = tmp_path_factory.mktemp("espeak")
    parts, truth, position = [], [], 0
    for text, pause_s in zip(ESPEAK_TEXTS, (0.6, 1.0, 1.1)):
        pause = np.zeros(round(pause_s * SR), dtype=np.float32)
        utterance = espeak(text, folder)
        start, end = speech_bounds(utterance)
        truth.append(((position + len(pause) + start) / SR, (position + len(pause) + end) / SR))
        parts += [pause, utterance]
        position += len(pause) + len(utterance)
    parts.append(np.zeros(round(0.2 * SR), dtype=np.float32))
    audio = np.concatenate(parts)
    audio += 0.002 * np.random.default_rng(0).standard_normal(len(audio)).astype(np.float32)
    return audio, truth


# ---- tests -----------------------------------------------------------------------------------------------------


def test_espeak_utterances_get_partials_then_one_final_each_equal_to_offline(engine, offline, espeak_stream):
    audio, truth = espeak_stream

    async def main():
        async with serving(engine) as server:
            return await stream(server, audio, speed=2.0, start={"partial_interval_ms": 250, "vad": EXACT})

    result = run(main())
    assert result.close_code == 1000
    assert_well_ordered(result.events)
    assert_finals_match_truth(result, truth)
    assert [final["reason"] for final in result.finals()] == ["silence", "silence", "end"]
    for final in result.finals():  # while each utterance was spoken, partials came back
        assert any(event["type"] == "partial" and event["segment_id"] == final["segment_id"]
                   for event in result.events)
        assert final["latency_ms"] >= 0
    assert_finals_equal_offline([result], offline)
    assert result.events[-1]["speech_seconds"] == pytest.approx(sum(end - start for start, end in truth), abs=0.3)


def session_audio(index: int, count: int) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Two bursts of lengths no other session has, 0.5 s + 100 ms steps: the random model's transcripts depend on
    the number of audio tokens (one per ~77 ms), so every segment of every session gets a transcript of its own."""
    first, second = 0.5 + 0.1 * index, 0.5 + 0.1 * (2 * count - 1 - index)
    return speech_like([("silence", 0.3 + 0.01 * index), ("speech", first), ("silence", 0.8), ("speech", second),
                        ("silence", 0.7)], seed=100 + index)


def test_two_dozen_concurrent_sessions_each_get_the_finals_of_their_own_audio(engine, offline):
    count = 24

    async def main():
        async with serving(engine, max_sessions=32) as server:
            results = await asyncio.gather(*(
                stream(server, session_audio(i, count)[0], speed=4.0,
                       start={"partial_interval_ms": 300, "language": "English" if i % 2 else None, "vad": EXACT})
                for i in range(count)))
            await until(lambda: idle(engine.stats()))  # every slot and stream released (at the engine's next step)
            return results, engine.stats()

    results, stats = run(main())
    session_ids = set()
    for i, result in enumerate(results):
        assert result.close_code == 1000, i
        session_ids.add(result.events[0]["session_id"])
        assert_well_ordered(result.events)
        assert_finals_match_truth(result, session_audio(i, count)[1])
        assert {final["language"] for final in result.finals()} == {"English" if i % 2 else ""}
    assert len(session_ids) == count  # (partials are best effort: under this load they may all be superseded)
    assert_finals_equal_offline(results, offline)
    # ... and those transcripts tell every segment apart, so none can have reached another session
    assert len({final["text"] for result in results for final in result.finals()}) == 2 * count
    assert stats["counters"]["decode_rows"] > stats["steps"]  # the sessions really shared decode steps


def test_a_vanished_client_leaves_no_engine_work_streams_tasks_or_sessions(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = TrackedEngine(Engine(model, tokenizer, OPTIONS))
    # one message: the first segment closes (its final is due) and the second is open (its first partial is due)
    audio, _ = speech_like([("silence", 0.3), ("speech", 2.5), ("silence", 0.7), ("speech", 3.0)], seed=5)

    async def main():
        async with serving(engine) as server:
            await asyncio.sleep(0.05)
            baseline = asyncio.all_tasks()
            websocket = await connect(url(server))
            await websocket.send(json.dumps({"type": "start", "partial_interval_ms": 200}))
            await websocket.send(to_s16le(audio))
            await until(lambda: engine.awaited["FINAL"] and engine.awaited["PARTIAL"], poll_s=0.001)
            awaited = dict(engine.awaited)
            websocket.transport.abort()  # gone mid-sentence, without a closing handshake
            await until(lambda: server.metrics.sessions_active == 0 and not server.connections)
            await until(lambda: not any(engine.awaited.values()))
            await until(lambda: idle(engine.stats()))
            await until(lambda: not asyncio.all_tasks() - baseline - {asyncio.current_task()})
            return awaited, engine.stats()

    awaited, after = run(main())
    assert awaited == {"FINAL": 1, "PARTIAL": 1}  # it vanished with a final and a partial in the engine
    assert idle(after)


def test_malformed_input_closes_that_session_only_while_another_keeps_streaming(engine, offline):
    good_audio, good_truth = speech_like([("silence", 0.3), ("speech", 0.9), ("silence", 0.8), ("speech", 1.2),
                                          ("silence", 0.8), ("speech", 0.7), ("silence", 0.7)], seed=11)
    bad_audio, _ = speech_like([("silence", 0.3), ("speech", 1.1)], seed=12)

    async def main():
        async with serving(engine) as server:
            good = asyncio.ensure_future(stream(server, good_audio, speed=3.0,
                                                start={"partial_interval_ms": 300, "vad": EXACT}))
            await until(lambda: server.metrics.sessions_active >= 1)
            bad = Stream(decode_pcm(to_s16le(bad_audio), "s16le")[:, 0], None)
            async with connect(url(server)) as websocket:
                await websocket.send(json.dumps({"type": "start", "partials": False, "vad": EXACT}))
                await websocket.send(to_s16le(bad_audio))
                await websocket.send(b"\x01")  # half a sample
                await receive_all(websocket, bad.events)
                bad.close_code = websocket.close_code
            good = await good
            await until(lambda: idle(engine.stats()))
            return good, bad

    good, bad = run(main())
    assert bad.close_code == 1007
    assert [event["type"] for event in bad.events] == ["ready", "speech_started", "error", "final", "summary"]
    assert bad.events[2]["code"] == "malformed" and bad.events[2]["fatal"] is True
    assert bad.finals()[0]["reason"] == "end"
    assert good.close_code == 1000
    assert_well_ordered(good.events)
    assert_finals_match_truth(good, good_truth)
    assert_finals_equal_offline([good, bad], offline)
