"""The native protocol as the client speaks it (docs/protocol.md), sans-I/O: the one place that knows the wire.

`StreamOptions` becomes the `start` message; `Credentials` the handshake's API key header or token subprotocol;
`encode_audio` turns numpy chunks into binary PCM frames;
`END`/`FLUSH` are the control messages; `parse_event` turns a server frame (JSON text or msgpack binary) into the
typed events of `qasr.streaming.events`. Nothing here touches a socket.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Mapping

import msgpack
import numpy as np

from qasr.audio import ENCODINGS, SAMPLE_RATE, g711
from qasr.client.errors import ProtocolMismatch
from qasr.streaming.events import Error, Final, Partial, Ready, ServerEvent, SpeechStarted, Summary, Word

SENT_ENCODINGS = ("s16le", "f32le", "mulaw", "alaw")  # qasr.audio.ENCODINGS this client encodes numpy audio into
FORMATS = ("json", "msgpack")
EVENT_TYPES = {cls.TYPE: cls for cls in (Ready, SpeechStarted, Partial, Final, Error, Summary)}

TOKEN_SUBPROTOCOL = "qasr.token."  # + a token from POST /v1/tokens (qasr.server.auth reads it)
_HEADER_VALUE = re.compile(r"[!-~]+")  # visible ASCII: what an Authorization header can carry unchanged
_SUBPROTOCOL = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token, as Sec-WebSocket-Protocol needs

END = json.dumps({"type": "end"})
FLUSH = json.dumps({"type": "flush"})


@dataclass(frozen=True)
class StreamOptions:
    """What the client asks for in `start`; None leaves a setting to the server's default."""

    sample_rate: int = SAMPLE_RATE  # Hz of the audio sent
    encoding: str = "s16le"  # on the wire: "s16le" (half f32le's bytes), "f32le", or G.711 "mulaw"/"alaw" (1 byte,
    #                          telephony audio, usually at 8000 Hz)
    channels: int = 1  # interleaved; the server averages them to mono
    language: str | None = None  # e.g. "English"; None: the model detects it
    context: str = ""  # names, topic, spellings the model should prefer
    format: str = "json"  # how events come back: "json" text frames or "msgpack" binary frames
    partials: bool = True  # send hypotheses while a segment grows
    partial_interval_ms: int | None = None  # new speech between partials (server default: 1000)
    vad: Mapping[str, float] | None = None  # {"end_silence_ms": 500, "aggressiveness": 2, ...}
    words: bool = False  # word times on every final (a server started with --aligner; others refuse with 1003)

    def __post_init__(self):
        if isinstance(self.sample_rate, bool) or not isinstance(self.sample_rate, int) or self.sample_rate <= 0:
            raise ValueError(f"sample_rate must be a positive integer number of Hz, got {self.sample_rate!r}")
        if self.encoding not in SENT_ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(SENT_ENCODINGS)}, got {self.encoding!r}")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if isinstance(self.channels, bool) or not isinstance(self.channels, int) or self.channels < 1:
            raise ValueError(f"channels must be a positive integer, got {self.channels!r}")
        if not isinstance(self.words, bool):
            raise ValueError(f"words must be True or False, got {self.words!r}")


@dataclass(frozen=True)
class Credentials:
    """What the client shows at the handshake (docs/security.md): an API key, sent as `Authorization: Bearer KEY`,
    or a short-lived token minted by POST /v1/tokens, sent as the `qasr.token.TOKEN` subprotocol; neither for a
    server without authentication. The secrets stay out of repr (and so out of logs and tracebacks)."""

    api_key: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.api_key is not None and self.token is not None:
            raise ValueError("give api_key or token, not both (a token is minted with a key)")
        for name, secret, pattern, what in (("api_key", self.api_key, _HEADER_VALUE, "an HTTP header"),
                                            ("token", self.token, _SUBPROTOCOL, "a WebSocket subprotocol")):
            if secret is None:
                continue
            if not isinstance(secret, str) or not secret.strip():
                raise ValueError(f"{name} must be a non-empty string (or None for a server without keys)")
            if not pattern.fullmatch(secret.strip()):  # the error never shows the secret itself
                raise ValueError(f"{name} has characters {what} cannot carry (spaces, line breaks, non-ASCII): "
                                 "is it the whole key, copied without anything around it?")
            object.__setattr__(self, name, secret.strip())

    @property
    def kind(self) -> str | None:
        """What is sent: "api_key", "token" or None."""
        return "api_key" if self.api_key is not None else "token" if self.token is not None else None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key is not None else {}

    def subprotocols(self) -> list[str]:
        return [TOKEN_SUBPROTOCOL + self.token] if self.token is not None else []

    def redact(self, text: str) -> str:
        """`text` with the secret blanked out, for messages built from what a server or proxy answered."""
        secret = self.api_key or self.token
        return text.replace(secret, "***") if secret else text


def bytes_per_frame(options: StreamOptions) -> int:
    """Bytes of one sample on every channel, on the wire."""
    return ENCODINGS[options.encoding] * options.channels


def start_message(options: StreamOptions) -> str:
    """The `start` text frame for `options` (server defaults wherever an option is None)."""
    message = {"type": "start", "sample_rate": options.sample_rate, "encoding": options.encoding,
               "channels": options.channels, "language": options.language, "context": options.context,
               "format": options.format, "partials": options.partials}
    if options.partial_interval_ms is not None:
        message["partial_interval_ms"] = options.partial_interval_ms
    if options.vad:
        message["vad"] = dict(options.vad)
    if options.words:  # only when asked: a server without an aligner refuses it
        message["words"] = True
    return json.dumps(message, ensure_ascii=False)


def encode_audio(chunk: np.ndarray, options: StreamOptions) -> bytes:
    """One binary audio frame. chunk: [n] (interleaved if several channels) or [n, channels]; float in [-1, 1]
    or int16. Floats are clipped; s16le rounds to the nearest step, mulaw/alaw to the nearest G.711 level."""
    chunk = np.asarray(chunk)
    if chunk.ndim == 2 and chunk.shape[1] != options.channels:
        raise ValueError(f"audio chunk has {chunk.shape[1]} channels, the stream was started with {options.channels}")
    if chunk.ndim > 2:
        raise ValueError(f"audio chunks are [samples] or [samples, channels], got shape {chunk.shape}")
    if chunk.size % options.channels:
        raise ValueError(f"an interleaved chunk of {chunk.size} samples does not split into {options.channels} "
                         "channels")
    if chunk.dtype == np.int16:
        if options.encoding == "s16le":
            return chunk.astype("<i2", copy=False).tobytes()
        chunk = chunk.astype(np.float32) / np.float32(32768.0)
    elif not np.issubdtype(chunk.dtype, np.floating):
        raise ValueError(f"audio chunks must be float or int16 samples, got {chunk.dtype}")
    chunk = np.clip(chunk, -1.0, 1.0)
    if options.encoding == "f32le":
        return chunk.astype("<f4", copy=False).tobytes()
    if options.encoding in ("mulaw", "alaw"):
        return g711.encode(chunk, options.encoding)
    return np.round(chunk * 32767.0).astype("<i2").tobytes()


def parse_event(frame: str | bytes) -> ServerEvent | None:
    """The event in a server frame; None for an event type this client does not know (newer servers may add
    some). Unknown fields are ignored. Raises ProtocolMismatch for a frame that is not a qasr event."""
    try:
        payload = json.loads(frame) if isinstance(frame, str) else msgpack.unpackb(frame, raw=False)
    except (ValueError, msgpack.UnpackException) as error:
        raise ProtocolMismatch(f"the server sent a frame that is neither JSON nor msgpack: {error}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("type"), str):
        raise ProtocolMismatch(f"the server sent a frame without an event type: {str(payload)[:200]}")
    event_type = EVENT_TYPES.get(payload["type"])
    if event_type is None:
        return None
    known = {field.name for field in dataclasses.fields(event_type)}
    fields = {name: value for name, value in payload.items() if name in known}
    try:
        if event_type is Final and fields.get("words") is not None:
            fields["words"] = _words(fields["words"])
        return event_type(**fields)
    except TypeError as error:  # a field is missing, or words of the wrong shape
        raise ProtocolMismatch(f"the server's {payload['type']!r} event is not what this client expects: "
                               f"{error}") from None


def _words(items) -> tuple[Word, ...]:
    """A final's `words` ([{"word", "start", "end"}, ...]) as `Word`s; TypeError for any other shape."""
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise TypeError(f"words must be a list of {{word, start, end}} objects, got {str(items)[:100]}")
    try:
        return tuple(Word(str(item["word"]), float(item["start"]), float(item["end"])) for item in items)
    except (KeyError, ValueError) as error:
        raise TypeError(f"a word lacks a word, start or end: {error}") from None
