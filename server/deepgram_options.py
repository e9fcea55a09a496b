"""A Deepgram live stream's options, read from the `/v1/listen` query string, and the qasr stream settings they
map to. Deepgram sends everything as query parameters (booleans as "true"/"false"); the ones qasr cannot honour
are accepted and ignored, as docs/integrations.md lists.

    options = ListenOptions.parse("encoding=linear16&sample_rate=16000&interim_results=true")
    settings = options.stream_settings(defaults)      # the caller's StreamLimits check it
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from dataclasses import dataclass

from qasr.server.errors import UnsupportedFormat
from qasr.server.languages import canonical_language
from qasr.streaming.settings import StreamSettings

ENCODINGS = {"linear16": "s16le", "mulaw": "mulaw", "alaw": "alaw"}  # Deepgram encoding -> qasr encoding
DEFAULT_RATES = {"linear16": 16000, "mulaw": 8000, "alaw": 8000}
END_SILENCE_MS = (100, 5000)  # what qasr's VAD accepts; Deepgram's `endpointing` is clamped into it
NO_ENDPOINTING_MS = END_SILENCE_MS[1]  # endpointing=false: segments close on the longest silence or their length


class QueryError(UnsupportedFormat):
    """A query parameter qasr cannot take: the handshake is refused (HTTP 400), as Deepgram refuses it."""


@dataclass(frozen=True)
class ListenOptions:
    encoding: str = "linear16"
    sample_rate: int | None = None  # None: the encoding's usual rate
    channels: int = 1
    multichannel: bool = False  # True: each channel its own segments (results carry channel_index [c, N])
    interim_results: bool = False  # partials as Results with is_final false
    endpointing_ms: int | None = None  # None: qasr's default end silence
    utterance_end_ms: int | None = None  # set: an UtteranceEnd follows each final that silence ended
    vad_events: bool = False  # SpeechStarted messages
    language: str | None = None  # canonical name; None: detect ("multi" or left out)
    model: str = "qasr"  # reported in metadata, never enforced
    keyterms: tuple[str, ...] = ()  # keyterm / keywords -> the decoder context

    @classmethod
    def parse(cls, query: str) -> "ListenOptions":
        """Options from a raw query string. Raises QueryError naming the parameter."""
        params = urllib.parse.parse_qs(query, keep_blank_values=True)

        def last(name: str) -> str | None:
            values = params.get(name)
            return values[-1] if values else None

        encoding = last("encoding") or "linear16"
        if encoding not in ENCODINGS:
            raise QueryError(f"encoding={encoding} is not supported: use {', '.join(ENCODINGS)} (raw audio; "
                             "containers such as WAV or Opus are not decoded)")
        endpointing = last("endpointing")
        keyterms = [*params.get("keyterm", []), *(value.rsplit(":", 1)[0] if _has_boost(value) else value
                                                   for value in params.get("keywords", []))]
        try:
            language = canonical_language(last("language"))
        except ValueError as error:
            raise QueryError(str(error)) from None
        return cls(encoding=encoding,
                   sample_rate=_integer("sample_rate", last("sample_rate")),
                   channels=_integer("channels", last("channels")) or 1,
                   multichannel=_boolean("multichannel", last("multichannel")),
                   interim_results=_boolean("interim_results", last("interim_results")),
                   endpointing_ms=(None if endpointing is None
                                   else NO_ENDPOINTING_MS if endpointing.lower() == "false"
                                   else _integer("endpointing", endpointing)),
                   utterance_end_ms=_integer("utterance_end_ms", last("utterance_end_ms")),
                   vad_events=_boolean("vad_events", last("vad_events")),
                   language=language, model=last("model") or "qasr",
                   keyterms=tuple(term.strip() for term in keyterms if term.strip()))

    def stream_settings(self, defaults: StreamSettings) -> StreamSettings:
        """The stream settings these options ask for (SettingsError names a bad one)."""
        vad = defaults.vad
        if self.endpointing_ms is not None:
            end_silence = min(max(self.endpointing_ms, END_SILENCE_MS[0]), END_SILENCE_MS[1])
            vad = dataclasses.replace(vad, end_silence_ms=end_silence)
        return dataclasses.replace(
            defaults, sample_rate=self.sample_rate or DEFAULT_RATES[self.encoding],
            encoding=ENCODINGS[self.encoding], channels=self.channels, multichannel=self.multichannel,
            language=self.language, context=", ".join(self.keyterms), partials=self.interim_results, vad=vad)


def _has_boost(keyword: str) -> bool:
    """Deepgram keywords may end in ":<intensifier>" ("qasr:2"): the number is not part of the word."""
    head, _, boost = keyword.rpartition(":")
    try:
        float(boost)
    except ValueError:
        return False
    return bool(head)


def _integer(name: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise QueryError(f"{name}={value} is not an integer") from None
    if number < 0:
        raise QueryError(f"{name}={value} must not be negative")
    return number


def _boolean(name: str, value: str | None) -> bool:
    if value is None:
        return False
    if value.lower() not in ("true", "false"):
        raise QueryError(f"{name}={value} must be true or false")
    return value.lower() == "true"

