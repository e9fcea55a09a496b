"""The native streaming protocol, sans-I/O: frames in, commands out; server events in, frames out.

`NativeProtocol` is the wire adapter of `/v1/stream` (see qasr.server.connection.WireAdapter): it holds one
connection's wire state and never touches a socket. The connection hands it each received message (`str` for a text
frame, `bytes` for a binary one) and sends what `encode` returns. A `start` becomes the stream's settings:
`dataclasses.replace(defaults, **what_the_client_asked)`, checked against the server's stream limits. Fatal
problems raise a `ProtocolError` whose close code the server uses; problems that are not fatal come back as
`Notice` commands, which the server answers with an `error` event while the stream carries on. docs/protocol.md is
the contract this implements. Torch-free.

    AWAITING_START --start--> STREAMING --end--> ENDED
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math

import msgpack

from qasr.audio import AudioError, decode_pcm
from qasr.server.commands import Audio, Command, End, Flush, Notice, Start
from qasr.server.errors import MalformedMessage, MessageTooBig, UnsupportedFormat
from qasr.server.languages import NAMES as LANGUAGE_NAMES
from qasr.server.limits import ServerLimits
from qasr.streaming import events
from qasr.streaming.settings import SettingsError, StreamLimits, StreamSettings

FORMATS = ("json", "msgpack")  # how server events are framed: JSON text frames or msgpack binary frames
START_FIELDS = {"type", "sample_rate", "encoding", "channels", "multichannel", "language", "context", "format",
                "partials", "partial_interval_ms", "vad", "words"}
VAD_FIELDS = {"aggressiveness", "end_silence_ms", "pre_roll_ms", "max_segment_s"}
# the wire type of each `start` field that maps onto StreamSettings (VadSettings for vad.*)
FIELD_TYPES = {"sample_rate": int, "encoding": str, "channels": int, "multichannel": bool, "context": str,
               "partials": bool, "partial_interval_ms": int, "words": bool}
VAD_FIELD_TYPES = {"aggressiveness": int, "end_silence_ms": int, "pre_roll_ms": int, "max_segment_s": float}
# a value this server cannot take closes 1003 ("unsupported"; "words" without --aligner too), others 1007
UNSUPPORTED_FIELDS = {"sample_rate", "encoding", "channels", "words"}


class State(enum.Enum):
    AWAITING_START = "awaiting_start"
    STREAMING = "streaming"
    ENDED = "ended"


class NativeProtocol:
    """One connection of the native protocol. `receive` parses, `encode` serialises; no I/O."""

    def __init__(self, *, defaults: StreamSettings = StreamSettings(), stream_limits: StreamLimits = StreamLimits(),
                 limits: ServerLimits = ServerLimits()):
        self.defaults = defaults
        self.stream_limits = stream_limits
        self.limits = limits
        self.state = State.AWAITING_START
        self.settings: StreamSettings | None = None
        self.format = "json"

    def greeting(self) -> list[str | bytes]:
        return []  # the client speaks first (`start`)

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
        return self._receive_audio(message)

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
            notices: list[Command] = []
            self.settings = self._parse_start(message, notices)
            self.state = State.STREAMING
            return [Start(self.settings), *notices]
        if kind in ("flush", "end"):
            if self.state is State.AWAITING_START:
                raise MalformedMessage(f"`{kind}` before `start`: the first message must be `start`")
            if kind == "end":
                self.state = State.ENDED
                return [*_unknown_fields(message, {"type"}, kind), End()]  # the notices first: nothing after End
            return [Flush(self._flushed_channel(message)), *_unknown_fields(message, {"type", "channel"}, kind)]
        if kind is None:
            raise MalformedMessage('text frames need a "type": start, flush or end')
        raise MalformedMessage(f"unknown message type {kind!r}: use start, flush or end (audio goes in binary frames)")

    def _flushed_channel(self, message: dict) -> int | None:
        """`flush` may name one channel of a multichannel stream (`"channel": c`); without it every channel's open
        segment is finalised."""
        channel = message.get("channel")
        channels = self.settings.channels if self.settings.multichannel else 1
        if channel is None:
            return None
        if isinstance(channel, bool) or not isinstance(channel, int) or not 0 <= channel < channels:
            raise MalformedMessage(f"flush: channel must be an integer in 0..{channels - 1}, got {channel!r}")
        return channel

    def _receive_audio(self, data: bytes | bytearray | memoryview) -> list[Command]:
        if self.state is State.AWAITING_START:
            raise MalformedMessage("audio before `start`: the first message must be a `start` text frame")
        if not len(data):
            return []
        try:
            return [Audio(decode_pcm(data, self.settings.encoding, self.settings.channels))]
        except AudioError as error:
            raise MalformedMessage(str(error)) from None  # a partial sample, NaN/inf in f32le

    def _parse_start(self, message: dict, notices: list[Command]) -> StreamSettings:
        notices += _unknown_fields(message, START_FIELDS, "start")
        asked = {name: _typed(message, name, kind) for name, kind in FIELD_TYPES.items() if name in message}
        if "language" in message:
            asked["language"] = _language(message["language"])
        self.format = _typed(message, "format", str) if "format" in message else "json"
        if self.format not in FORMATS:
            raise UnsupportedFormat(f"format {self.format!r} is not supported: use {' or '.join(FORMATS)}")
        vad = message.get("vad", {})
        if not isinstance(vad, dict):
            raise MalformedMessage(f"vad must be an object, got {vad!r}")
        notices += _unknown_fields(vad, VAD_FIELDS, "vad")
        vad_asked = {name: _typed(vad, name, kind, "vad.") for name, kind in VAD_FIELD_TYPES.items() if name in vad}
        try:
            settings = dataclasses.replace(self.defaults, **asked,
                                           vad=dataclasses.replace(self.defaults.vad, **vad_asked))
            self.stream_limits.check(settings)
        except SettingsError as error:
            raise (UnsupportedFormat if error.field in UNSUPPORTED_FIELDS else MalformedMessage)(str(error)) from None
        return settings

    # -- server -> client ------------------------------------------------------------------------------------

    def encode(self, event: events.ServerEvent) -> list[str | bytes]:
        """The frames for `event`: JSON text, or msgpack binary once a `start` asked for format "msgpack". Nothing for
        `speech_ended` (the final says where the segment ended); `ready` gains the limits and the stream's config."""
        if isinstance(event, events.SpeechEnded):
            return []
        if isinstance(event, events.Ready):
            event = dataclasses.replace(event, limits={**self.limits.to_client(), **self.stream_limits.to_client()},
                                        config=self.config())
        payload = event_to_dict(event)
        if self.format == "msgpack":
            return [msgpack.packb(payload, use_bin_type=True)]
        return [json.dumps(payload, ensure_ascii=False, separators=(",", ":"))]

    def config(self) -> dict:
        """The stream's settings as the `start` message spells them, defaults filled in (the `ready` event's config)."""
        settings = self.settings or self.defaults
        config = {name: getattr(settings, name) for name in ("sample_rate", "encoding", "channels", "multichannel",
                                                             "language", "context")}
        config["format"] = self.format
        config.update(partials=settings.partials, partial_interval_ms=settings.partial_interval_ms,
                      vad=dataclasses.asdict(settings.vad), words=settings.words)
        return config


def event_to_dict(event: events.ServerEvent) -> dict:
    """{"type": ..., fields...}: the wire shape of a server event, the same for JSON and msgpack. `channel` only on
    the events of multichannel streams; a final's `words` only on streams that asked for them, `words_reason` only
    when they asked and there are none."""
    payload = {"type": event.TYPE, **dataclasses.asdict(event)}
    for optional in ("channel", "words", "words_reason"):
        if optional in payload and payload[optional] is None:
            del payload[optional]
    if "words" in payload:
        payload["words"] = list(payload["words"])  # [{"word", "start", "end"}, ...]
    return payload


def _unknown_fields(message: dict, known: set[str], where: str) -> list[Command]:
    unknown = sorted(str(key) for key in message if key not in known)
    if not unknown:
        return []
    return [Notice("unknown_field", f"{where}: ignored unknown field(s) {', '.join(unknown)}")]


def _typed(message: dict, name: str, kind: type, prefix: str = ""):
    """message[name] as the Python type the setting takes; MalformedMessage (1007) for a wrong wire type."""
    value = message[name]
    if kind is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)  # JSON numbers: 16000.0 is 16000
        if isinstance(value, bool) or not isinstance(value, int):
            raise MalformedMessage(f"{prefix}{name} must be an integer, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MalformedMessage(f"{prefix}{name} must be a number, got {value!r}")
        value = float(value)
    elif kind is bool:
        if not isinstance(value, bool):
            raise MalformedMessage(f"{prefix}{name} must be true or false, got {value!r}")
    elif not isinstance(value, str):
        raise MalformedMessage(f"{prefix}{name} must be a string, got {value!r}")
    return value


def _language(language) -> str | None:
    """null, "" or "auto": detect; otherwise a language Qwen3-ASR knows, any case -> its canonical name."""
    if language is None or (isinstance(language, str) and language.strip().lower() in ("", "auto")):
        return None
    if not isinstance(language, str):
        raise MalformedMessage(f"language must be a string or null, got {language!r}")
    canonical = LANGUAGE_NAMES.get(language.strip().lower())
    if canonical is None:
        raise UnsupportedFormat(f"language {language!r} is not supported: use one of "
                                f"{', '.join(sorted(set(LANGUAGE_NAMES.values())))}")
    return canonical
