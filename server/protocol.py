"""The native streaming protocol, sans-I/O: frames in, typed commands out; server events in, frames out.

`NativeProtocol` holds one connection's wire state and never touches a socket: the asyncio layer hands it each
received message (`str` for a text frame, `bytes` for a binary one) and sends what `encode` returns. Fatal problems
raise a `ProtocolError` whose close code the server uses; problems that are not fatal come back as `Notice`
commands, which the server answers with an `error` event while the stream carries on. docs/protocol.md is the
contract this implements.

    AWAITING_START --start--> STREAMING --end--> ENDED
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass
from typing import Callable, Union

import msgpack
import numpy as np

from qasr.audio import AudioError, decode_pcm, downmix
from qasr.model.prompt import normalize_language
from qasr.server.errors import MalformedMessage, MessageTooBig, UnsupportedFormat
from qasr.server.limits import ServerLimits, StreamDefaults
from qasr.streaming import events
from qasr.streaming.vad import VadOptions

ENCODINGS = {"s16le": 2, "f32le": 4}  # wire encoding -> bytes per sample
FORMATS = ("json", "msgpack")  # how server events are framed: JSON text frames or msgpack binary frames
VAD_AGGRESSIVENESS = (0, 3)
END_SILENCE_MS = (100, 5000)
PRE_ROLL_MS = (0, 2000)

START_FIELDS = {"type", "sample_rate", "encoding", "channels", "language", "context", "format", "partials",
                "partial_interval_ms", "vad"}
VAD_FIELDS = {"aggressiveness", "end_silence_ms", "pre_roll_ms", "max_segment_s"}


@dataclass(frozen=True)
class VadSettings:
    aggressiveness: int  # webrtcvad 0..3
    end_silence_ms: int  # silence that closes a segment
    pre_roll_ms: int  # audio kept before the speech start
    max_segment_s: float  # longer speech is cut

    def to_options(self) -> VadOptions:
        """The segmenter's options (raises ValueError for combinations it cannot honour)."""
        return VadOptions(aggressiveness=self.aggressiveness, end_silence_ms=self.end_silence_ms,
                          pre_roll_ms=self.pre_roll_ms, max_segment_s=self.max_segment_s,
                          cut_window_s=min(VadOptions.cut_window_s, self.max_segment_s))


@dataclass(frozen=True)
class StreamConfig:
    """A validated `start` message, with the server's defaults filled in."""

    sample_rate: int = 16000  # Hz, of the audio the client sends
    encoding: str = "s16le"  # "s16le" | "f32le"
    channels: int = 1  # interleaved; averaged to mono
    language: str | None = None  # canonical language name; None: detect
    context: str = ""  # hints for the decoder: names, topic, spelling
    format: str = "json"  # "json" | "msgpack": how server events are framed
    partials: bool = True
    partial_interval_ms: int = 1000
    vad: VadSettings = VadSettings(2, 500, 300, 30.0)

    @property
    def bytes_per_frame(self) -> int:
        """Bytes of one sample on every channel."""
        return ENCODINGS[self.encoding] * self.channels


@dataclass(frozen=True)
class Start:
    config: StreamConfig


@dataclass(frozen=True)
class Audio:
    samples: np.ndarray  # float32 mono at config.sample_rate, in [-1, 1)


@dataclass(frozen=True)
class Flush:
    """Finalise the open segment now."""


@dataclass(frozen=True)
class End:
    """No more audio: finalise, send every final, then the summary, then close 1000."""


@dataclass(frozen=True)
class Notice:
    """A problem that is not fatal: answer with an `error` event and carry on."""

    code: str
    message: str


Command = Union[Start, Audio, Flush, End, Notice]


class State(enum.Enum):
    AWAITING_START = "awaiting_start"
    STREAMING = "streaming"
    ENDED = "ended"


class NativeProtocol:
    """One connection of the native protocol. `receive` parses, `encode` serialises; no I/O."""

    def __init__(self, *, limits: ServerLimits = ServerLimits(), defaults: StreamDefaults = StreamDefaults(),
                 normalize_language: Callable[[str], str] = normalize_language):
        self.limits = limits
        self.defaults = defaults
        self.normalize_language = normalize_language
        self.state = State.AWAITING_START
        self.config: StreamConfig | None = None

    # -- client -> server ------------------------------------------------------------------------------------

    def receive(self, message: str | bytes | bytearray | memoryview) -> list[Command]:
        """Parse one client message. Raises MalformedMessage (1007), UnsupportedFormat (1003), MessageTooBig (1009)."""
        size = len(message.encode()) if isinstance(message, str) else len(message)
        if size > self.limits.max_message_bytes:
            raise MessageTooBig(f"message of {size} bytes is over the limit of {self.limits.max_message_bytes}")
        if self.state is State.ENDED:
            return [Notice("ignored", "the stream has ended; message ignored")]
        if isinstance(message, str):
            return self._receive_text(message)
        return self._receive_audio(bytes(message))

    def _receive_text(self, text: str) -> list[Command]:
        try:
            message = json.loads(text)
        except (ValueError, RecursionError) as error:  # RecursionError: nesting too deep for the parser
            raise MalformedMessage(f"text frames must be JSON objects: {error}") from None
        if not isinstance(message, dict):
            raise MalformedMessage(f"text frames must be JSON objects, got {type(message).__name__}")
        kind = message.get("type")
        if kind == "start":
            if self.state is not State.AWAITING_START:
                raise MalformedMessage("the stream has already started: send `start` once")
            notices = []
            self.config = self._parse_start(message, notices)
            self.state = State.STREAMING
            return [Start(self.config), *notices]
        if kind in ("flush", "end"):
            if self.state is State.AWAITING_START:
                raise MalformedMessage(f"`{kind}` before `start`: the first message must be `start`")
            notices = _unknown_fields(message, {"type"}, kind)
            if kind == "end":
                self.state = State.ENDED
                return [*notices, End()]  # the notices first: nothing after End is read
            return [Flush(), *notices]
        if kind is None:
            raise MalformedMessage('text frames need a "type": start, flush or end')
        raise MalformedMessage(f"unknown message type {kind!r}: use start, flush or end (audio goes in binary frames)")

    def _receive_audio(self, data: bytes) -> list[Command]:
        if self.state is State.AWAITING_START:
            raise MalformedMessage("audio before `start`: the first message must be a `start` text frame")
        config = self.config
        if len(data) % config.bytes_per_frame:
            raise MalformedMessage(
                f"audio frames must hold whole samples on all channels ({config.bytes_per_frame} bytes each for "
                f"{config.channels} x {config.encoding}), got {len(data)} bytes")
        if not data:
            return []
        try:
            samples = decode_pcm(data, config.encoding, config.channels)
        except AudioError as error:
            raise MalformedMessage(str(error)) from None
        return [Audio(downmix(samples))]

    def _parse_start(self, message: dict, notices: list[Notice]) -> StreamConfig:
        limits, defaults = self.limits, self.defaults
        notices += _unknown_fields(message, START_FIELDS, "start")
        sample_rate = _integer(message, "sample_rate", 16000)
        if not limits.min_sample_rate <= sample_rate <= limits.max_sample_rate:
            raise UnsupportedFormat(f"sample_rate {sample_rate} is not supported: use "
                                    f"{limits.min_sample_rate}..{limits.max_sample_rate} Hz")
        encoding = _string(message, "encoding", "s16le")
        if encoding not in ENCODINGS:
            raise UnsupportedFormat(f"encoding {encoding!r} is not supported: use {' or '.join(ENCODINGS)}")
        channels = _integer(message, "channels", 1)
        if not 1 <= channels <= limits.max_channels:
            raise UnsupportedFormat(f"channels {channels} is not supported: use 1..{limits.max_channels}")
        event_format = _string(message, "format", "json")
        if event_format not in FORMATS:
            raise UnsupportedFormat(f"format {event_format!r} is not supported: use {' or '.join(FORMATS)}")
        context = _string(message, "context", "")
        if len(context) > limits.max_context_chars:
            raise MalformedMessage(f"context has {len(context)} characters; the limit is {limits.max_context_chars}")
        partials = message.get("partials", defaults.partials)
        if not isinstance(partials, bool):
            raise MalformedMessage(f"partials must be true or false, got {partials!r}")
        interval = _integer(message, "partial_interval_ms", defaults.partial_interval_ms)
        _check_range("partial_interval_ms", interval, limits.min_partial_interval_ms, limits.max_partial_interval_ms)
        return StreamConfig(sample_rate=sample_rate, encoding=encoding, channels=channels,
                            language=self._parse_language(message.get("language")), context=context,
                            format=event_format, partials=partials, partial_interval_ms=interval,
                            vad=self._parse_vad(message.get("vad"), notices))

    def _parse_language(self, language) -> str | None:
        if language is None or (isinstance(language, str) and language.strip().lower() in ("", "auto")):
            return None
        if not isinstance(language, str):
            raise MalformedMessage(f"language must be a string or null, got {language!r}")
        try:
            return self.normalize_language(language)
        except ValueError as error:
            raise UnsupportedFormat(f"language {language!r} is not supported: {error}") from None

    def _parse_vad(self, vad, notices: list[Notice]) -> VadSettings:
        defaults = self.defaults
        if vad is None:
            vad = {}
        if not isinstance(vad, dict):
            raise MalformedMessage(f"vad must be an object, got {vad!r}")
        notices += _unknown_fields(vad, VAD_FIELDS, "vad")
        settings = VadSettings(
            aggressiveness=_integer(vad, "aggressiveness", defaults.vad_aggressiveness, "vad."),
            end_silence_ms=_integer(vad, "end_silence_ms", defaults.end_silence_ms, "vad."),
            pre_roll_ms=_integer(vad, "pre_roll_ms", defaults.pre_roll_ms, "vad."),
            max_segment_s=_number(vad, "max_segment_s", min(defaults.max_segment_s, self.limits.max_segment_s),
                                  "vad."))
        _check_range("vad.aggressiveness", settings.aggressiveness, *VAD_AGGRESSIVENESS)
        _check_range("vad.end_silence_ms", settings.end_silence_ms, *END_SILENCE_MS)
        _check_range("vad.pre_roll_ms", settings.pre_roll_ms, *PRE_ROLL_MS)
        _check_range("vad.max_segment_s", settings.max_segment_s, 1.0, self.limits.max_segment_s)
        try:
            settings.to_options()
        except ValueError as error:
            raise MalformedMessage(f"vad: {error}") from None
        return settings

    # -- server -> client ------------------------------------------------------------------------------------

    def encode(self, event: events.ServerEvent) -> str | bytes:
        """The frame for `event`: JSON text, or msgpack binary once a `start` asked for format "msgpack"."""
        payload = event_to_dict(event)
        if self.config is not None and self.config.format == "msgpack":
            return msgpack.packb(payload, use_bin_type=True)
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def event_to_dict(event: events.ServerEvent) -> dict:
    """{"type": ..., fields...}: the wire shape of a server event, the same for JSON and msgpack."""
    return {"type": event.TYPE, **dataclasses.asdict(event)}


def _unknown_fields(message: dict, known: set[str], where: str) -> list[Notice]:
    unknown = sorted(str(key) for key in message if key not in known)
    if not unknown:
        return []
    return [Notice("unknown_field", f"{where}: ignored unknown field(s) {', '.join(unknown)}")]


def _integer(message: dict, name: str, default: int, prefix: str = "") -> int:
    value = message.get(name, default)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedMessage(f"{prefix}{name} must be an integer, got {value!r}")
    return value


def _number(message: dict, name: str, default: float, prefix: str = "") -> float:
    value = message.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MalformedMessage(f"{prefix}{name} must be a number, got {value!r}")
    return float(value)


def _string(message: dict, name: str, default: str) -> str:
    value = message.get(name, default)
    if not isinstance(value, str):
        raise MalformedMessage(f"{name} must be a string, got {value!r}")
    return value


def _check_range(name: str, value, low, high) -> None:
    if not low <= value <= high:
        raise MalformedMessage(f"{name} must be between {low} and {high}, got {value}")
