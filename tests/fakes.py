"""Test doubles for the server and session tests: a fake engine and speech-like synthetic audio.

`FakeEngine` has exactly the interface of `qasr.engine.engine.AsyncEngine` that sessions and the server use;
its "transcript" describes the audio length ("1.23s"), so tests can check which audio each request carried.
`speech_like` builds voiced harmonic bursts separated by silence, which webrtcvad cuts where the pauses are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import types

import numpy as np

from qasr.engine.request import DecodeRequest, DecodeResult, EngineClosed, Priority, Superseded

SAMPLE_RATE = 16000


def stand_in_sounddevice(input_stream) -> types.SimpleNamespace:
    """The part of the sounddevice module MicrophoneSource uses, with one 16 kHz mono device and `input_stream` as
    its InputStream class (constructed with callback=, blocksize=, channels=, ...)."""

    class PortAudioError(Exception):
        pass

    device = {"name": "stand-in microphone", "default_samplerate": 16000.0, "max_input_channels": 1}
    return types.SimpleNamespace(PortAudioError=PortAudioError, query_devices=lambda *args, **kwargs: device,
                                 check_input_settings=lambda *args, **kwargs: None, InputStream=input_stream,
                                 default=types.SimpleNamespace(device=(0, 0)))


def describe_audio(request: DecodeRequest) -> str:
    return f"{len(request.audio) / SAMPLE_RATE:.2f}s"


@dataclasses.dataclass
class FakeCall:
    request: DecodeRequest
    future: asyncio.Future  # resolved by complete()/fail() in manual mode
    started: bool = False  # manual mode: taken out of the queue (no longer supersedable)


FAKE_TIMINGS_MS = {"queue_ms": 4.0, "encode_ms": 3.0, "prefill_ms": 2.0, "decode_ms": 60.0}


class FakeEngine:
    """AsyncEngine's interface without a model.

    delay_s: each transcribe takes this long. manual=True: each call waits until the test calls complete()/fail(),
    so tests decide the order in which work finishes. A queued PARTIAL is superseded by a newer PARTIAL of the same
    stream (manual mode: until it is completed; delay mode: while it sleeps), like the real scheduler.
    """

    def __init__(self, *, model_name: str = "fake-qwen3-asr", delay_s: float = 0.0, manual: bool = False,
                 ready: bool = True):
        self.model_name = model_name
        self.delay_s = delay_s
        self.manual = manual
        self.ready = ready
        self.closed = False
        self.calls: list[FakeCall] = []  # every request, in arrival order
        self.waiting: list[FakeCall] = []  # calls not finished yet
        self.cancelled: list[DecodeRequest] = []  # requests whose awaiting task was cancelled
        self.superseded: list[DecodeRequest] = []
        self.released: list[str] = []  # release_stream() arguments, in order
        self.streams: set[str] = set()  # stream ids that have had work and were not released since
        self.fail_with: BaseException | None = None  # raise this from every transcribe (delay mode)
        self._arrived = asyncio.Condition()

    @classmethod
    def from_pretrained(cls, model, *, device="cpu", dtype=None, **options) -> "FakeEngine":
        return cls(model_name=str(model), **options)

    async def start(self) -> None:
        self.ready = True

    async def close(self) -> None:
        self.closed = True
        self.ready = False
        for call in self.waiting:
            if not call.future.done():
                call.future.set_exception(EngineClosed("engine closed"))

    def stats(self) -> dict:
        queued = [call.request.priority for call in self.waiting]
        return {
            "queue_depth": {"final": queued.count(Priority.FINAL), "partial": queued.count(Priority.PARTIAL)},
            "active_slots": len(self.waiting),
            "last_batch_sizes": [1, 2],
        }

    def release_stream(self, stream_id: str) -> None:
        self.released.append(stream_id)
        self.streams.discard(stream_id)

    MAX_CONTEXT_CHARS = 500  # the fake's stand-in for "the context leaves no room in a slot"

    def check_context(self, context: str, *, language=None, max_audio_seconds: float) -> None:
        if len(context) > self.MAX_CONTEXT_CHARS:
            raise ValueError(f"context too long: {len(context)} characters (fake limit {self.MAX_CONTEXT_CHARS})")

    async def transcribe(self, request: DecodeRequest) -> DecodeResult:
        if self.closed:
            raise EngineClosed("engine closed")
        call = FakeCall(request, asyncio.get_running_loop().create_future())
        self._supersede_older_partial(request)
        self.calls.append(call)
        self.waiting.append(call)
        if request.stream_id is not None:
            self.streams.add(request.stream_id)
        async with self._arrived:
            self._arrived.notify_all()
        try:
            if self.manual:
                return await call.future
            await asyncio.sleep(self.delay_s)
            if call.future.done():  # superseded or closed while sleeping
                return call.future.result()
            if self.fail_with is not None:
                raise self.fail_with
            return self.result_for(request)
        except asyncio.CancelledError:
            self.cancelled.append(request)
            raise
        finally:
            self.waiting.remove(call)

    def _supersede_older_partial(self, request: DecodeRequest) -> None:
        if request.priority is not Priority.PARTIAL or request.stream_id is None:
            return
        for call in self.waiting:
            same_stream = call.request.stream_id == request.stream_id
            if same_stream and call.request.priority is Priority.PARTIAL and not call.started:
                if not call.future.done():
                    self.superseded.append(call.request)
                    call.future.set_exception(Superseded("a newer partial replaced this one"))

    @staticmethod
    def result_for(request: DecodeRequest, text: str | None = None) -> DecodeResult:
        text = describe_audio(request) if text is None else text
        return DecodeResult(text=text, language="English", raw_text=f"language English<asr_text>{text}",
                            token_ids=tuple(range(len(text))), finish_reason="eos", num_audio_tokens=0,
                            timings=FAKE_TIMINGS_MS)

    # -- manual mode -----------------------------------------------------------------------------------------

    async def wait_for_calls(self, count: int, timeout: float = 5.0) -> None:
        """Until at least `count` calls have arrived in total."""
        async def arrived():
            async with self._arrived:
                await self._arrived.wait_for(lambda: len(self.calls) >= count)

        await asyncio.wait_for(arrived(), timeout)

    def pending(self, priority: Priority | None = None) -> list[FakeCall]:
        return [call for call in self.waiting
                if not call.future.done() and (priority is None or call.request.priority is priority)]

    def complete(self, call: FakeCall, text: str | None = None) -> None:
        call.started = True
        call.future.set_result(self.result_for(call.request, text))

    def fail(self, call: FakeCall, error: BaseException) -> None:
        call.started = True
        call.future.set_exception(error)


# ---------------------------------------------------------------------------------------------------------
# Speech-like audio
# ---------------------------------------------------------------------------------------------------------


def voiced_burst(seconds: float, *, f0: float = 140.0, sample_rate: int = SAMPLE_RATE, seed: int = 0) -> np.ndarray:
    """A vowel-like sound: harmonics of a wobbling f0 under two formant bumps, with soft 20 ms edges."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    t = np.arange(n) / sample_rate
    pitch = f0 * (1.0 + 0.05 * np.sin(2 * np.pi * 3.0 * t))  # slow vibrato
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    signal = np.zeros(n)
    for k in range(1, 25):
        frequency = k * f0
        if frequency > 0.45 * sample_rate:
            break
        formants = np.exp(-((frequency - 700) / 300) ** 2) + 0.6 * np.exp(-((frequency - 1800) / 400) ** 2)
        signal += (0.2 + formants) / k * np.sin(k * phase + rng.uniform(0, 2 * np.pi))
    signal *= 1.0 + 0.3 * np.sin(2 * np.pi * 4.0 * t)  # syllable-rate amplitude modulation
    edge = min(int(0.02 * sample_rate), n // 2)
    if edge:
        ramp = np.linspace(0.0, 1.0, edge)
        signal[:edge] *= ramp
        signal[n - edge:] *= ramp[::-1]
    return (0.3 * signal / max(np.abs(signal).max(), 1e-9)).astype(np.float32)


def speech_clip(seconds: float, seed: int = 0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Speech-like audio: voiced syllables (gliding pitch with harmonics, ~4 per second), pauses, a little noise."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    t = np.arange(n) / sample_rate
    f0 = 120 + 60 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6))  # Hz
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 20))
    syllables = np.clip(np.sin(2 * np.pi * rng.uniform(3, 5) * t + rng.uniform(0, 6)), 0, None) ** 2
    pauses = np.sin(2 * np.pi * 0.3 * t + rng.uniform(0, 6)) > -0.6
    noise = 0.02 * rng.standard_normal(n) * syllables + 1e-4 * rng.standard_normal(n)
    signal = 0.3 * voice * syllables * pauses + noise
    return signal.astype(np.float32)


def speech_like(pattern: list[tuple[str, float]], *, sample_rate: int = SAMPLE_RATE, noise: float = 1e-4,
                seed: int = 0) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Audio from [("speech", seconds) | ("silence", seconds), ...] and the true (start, end) of each burst.

    Silence carries a little white noise (real microphones are never digital zero).
    """
    rng = np.random.default_rng(seed)
    pieces, truth, position = [], [], 0
    for index, (kind, seconds) in enumerate(pattern):
        n = int(round(seconds * sample_rate))
        if kind == "speech":
            piece = voiced_burst(seconds, f0=120.0 + 15 * (index % 4), sample_rate=sample_rate, seed=seed + index)
            truth.append((position / sample_rate, (position + n) / sample_rate))
        elif kind == "silence":
            piece = np.zeros(n, dtype=np.float32)
        else:
            raise ValueError(f"pattern kinds are 'speech' and 'silence', got {kind!r}")
        pieces.append(piece + rng.normal(0.0, noise, n).astype(np.float32))
        position += n
    return np.concatenate(pieces).astype(np.float32), truth


def to_s16le(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
