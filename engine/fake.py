"""An engine without a model, for the server and session tests and the front-end benchmark
(bench/frontend_server.py).

`FakeEngine` implements `qasr.engine.face.SpeechEngine`; its "transcript" describes the audio length ("1.23s"), so
tests can check which audio each request carried. Torch-free: it imports only the request types.
"""

from __future__ import annotations

import asyncio
import dataclasses

from .request import DecodeRequest, DecodeResult, EngineClosed, Priority, Superseded, WordTime

SAMPLE_RATE = 16000  # Hz of DecodeRequest.audio


def describe_audio(request: DecodeRequest) -> str:
    return f"{len(request.audio) / SAMPLE_RATE:.2f}s"


def spread_words(request: DecodeRequest, text: str) -> tuple[WordTime, ...]:
    """The fake's word times: the text's words one after another over the clip, in equal shares (clip-relative)."""
    words = text.split()
    share = len(request.audio) / SAMPLE_RATE / max(1, len(words))
    return tuple(WordTime(word, round(i * share, 3), round((i + 1) * share, 3)) for i, word in enumerate(words))


@dataclasses.dataclass
class FakeCall:
    request: DecodeRequest
    future: asyncio.Future  # resolved by complete()/fail() in manual mode
    started: bool = False  # manual mode: taken out of the queue (no longer supersedable)


FAKE_TIMINGS_MS = {"queue_ms": 4.0, "encode_ms": 3.0, "prefill_ms": 2.0, "decode_ms": 60.0}


class FakeEngine:
    """The engine's face (qasr.engine.face.SpeechEngine) without a model.

    delay_s: each transcribe takes this long. manual=True: each call waits until the test calls complete()/fail(),
    so tests decide the order in which work finishes. A queued PARTIAL is superseded by a newer PARTIAL of the same
    stream (manual mode: until it is completed; delay mode: while it sleeps), like the real scheduler.
    """

    model_name: str

    def __init__(self, *, model_name: str = "fake-qwen3-asr", delay_s: float = 0.0, manual: bool = False,
                 ready: bool = True):
        self.model_name = model_name
        self.delay_s = delay_s
        self.manual = manual
        self._ready = ready
        self._error: BaseException | None = None
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

    @property
    def ready(self) -> bool:
        return self._ready

    @ready.setter
    def ready(self, value: bool) -> None:  # tests play a loading or a stuck engine
        self._ready = value

    @property
    def error(self) -> BaseException | None:
        return self._error

    @error.setter
    def error(self, value: BaseException | None) -> None:  # tests play a dead engine
        self._error = value

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

    async def check_context(self, context: str, *, language: str | None = None, max_audio_seconds: float) -> None:
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
                            timings=FAKE_TIMINGS_MS, words=spread_words(request, text) if request.words else None)

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
