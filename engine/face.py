"""The engine's one face: what the server and the sessions may use of an engine, and nothing more.

`AsyncEngine` (the engine on a thread of this process), `EngineProcess` (the engine in a process of its own) and
`FakeEngine` (no model: tests and the front-end benchmark) implement it; the server never probes an engine for
optional members or reaches through it. tests/engine/test_face.py checks each implementation's members and
signatures against this Protocol.
"""

from __future__ import annotations

import typing

from .request import DecodeRequest, DecodeResult


class SpeechEngine(typing.Protocol):
    model_name: str  # what clients are told (a local checkpoint's folder name or the hub id)

    @property
    def ready(self) -> bool:
        """Started and not failed."""

    @property
    def error(self) -> BaseException | None:
        """Set once the engine died (the server's /healthz then fails)."""

    async def start(self) -> None: ...

    async def close(self) -> None:
        """Work still pending gets EngineClosed."""

    async def transcribe(self, request: DecodeRequest) -> DecodeResult:
        """The result; raises Superseded (a newer partial of the stream replaced it), EngineClosed, ValueError."""

    def release_stream(self, stream_id: str) -> None:
        """Forget what the engine keeps for a stream (encoder windows, retained KV, the last partial's tokens)."""

    async def check_context(self, context: str, *, language: str | None, max_audio_seconds: float) -> None:
        """ValueError unless a request with this context and up to `max_audio_seconds` of audio fits a slot.

        Async: EngineProcess asks its process, since the server process holds no tokenizer."""

    def stats(self) -> dict: ...
