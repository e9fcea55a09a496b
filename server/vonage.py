"""Vonage Voice API WebSockets (NCCO `connect` to a `websocket` endpoint), sans-I/O; served at `/v1/vonage`.

The messages implemented (Vonage's documented shapes):

    text   {"event": "websocket:connected", "content-type": "audio/l16;rate=16000", <the NCCO's headers>...}
    binary 16-bit signed little-endian linear PCM, mono, at that rate (8000, 16000 or 24000 Hz), 20 ms a frame
    text   {"event": "websocket:dtmf", "digit": "5", "duration": 260}

Vonage streams the conversation's audio mixed into one channel (track "conversation", no speaker label). The
call id is the `call_id` query parameter of the endpoint URL, else the `call_id`, `conversation_uuid` or `uuid`
header the NCCO passes, else a generated one (the `call_started` message says which). The call ends when Vonage
closes the socket (its open segments are then finalised for the call); Vonage sends no end message and no pings.
A binary frame before `websocket:connected`, a frame that is not whole 16-bit samples, or a malformed text frame
closes the connection with 1007; a content type other than audio/l16 at a supported rate with 1003.
"""

from __future__ import annotations

import re
import uuid

from qasr.audio import AudioError, decode_pcm
from qasr.server.calls import CallRegistry, CallStream, Track
from qasr.server.commands import Audio, Command, Notice, Start
from qasr.server.errors import MalformedMessage, UnsupportedFormat
from qasr.server.media_stream import field, parse_json, stream_settings
from qasr.streaming import events
from qasr.streaming.settings import StreamLimits, StreamSettings

RATES = (8000, 16000, 24000)
CONTENT_TYPE = re.compile(r"^\s*audio/l16\s*;\s*rate\s*=\s*(\d+)\s*$", re.IGNORECASE)
CALL_ID_HEADERS = ("call_id", "conversation_uuid", "uuid")
TRACK = "conversation"


class VonageAdapter:
    PLATFORM = "vonage"
    finalise_on_disconnect = True  # Vonage ends a call by closing the socket: open segments get their finals

    def __init__(self, *, defaults: StreamSettings, limits: StreamLimits, calls: CallRegistry,
                 query: dict[str, str] | None = None):
        self.defaults = defaults
        self.limits = limits
        self.calls = calls
        self.query = query or {}
        self.settings: StreamSettings | None = None
        self.call: CallStream | None = None
        self.samples_received = 0

    def greeting(self) -> list[str | bytes]:
        return []

    def receive(self, message: str | bytes) -> list[Command]:
        if isinstance(message, str):
            return self._text(parse_json(message))
        if self.settings is None:
            raise MalformedMessage("audio before `websocket:connected`")
        try:
            samples = decode_pcm(message, "s16le", 1)
        except AudioError as error:
            raise MalformedMessage(str(error)) from None
        if not len(samples):
            return []
        self.samples_received += len(samples)
        self.call.audio(len(samples) / self.settings.sample_rate)
        return [Audio(samples)]

    def _text(self, message: dict) -> list[Command]:
        kind = message.get("event")
        if kind == "websocket:connected":
            return self._connected(message)
        if self.settings is None:
            raise MalformedMessage(f"{kind!r} before `websocket:connected`")
        if kind == "websocket:dtmf":
            digit = message.get("digit")
            if not isinstance(digit, str) or len(digit) != 1 or digit not in "0123456789*#":
                raise MalformedMessage(f"websocket:dtmf: {digit!r} is not a DTMF digit")
            self.call.dtmf(digit, self.samples_received / self.settings.sample_rate)
            return []
        return [Notice("unknown_event", f"vonage: ignored unknown event {str(kind)[:64]!r}")]

    def _connected(self, message: dict) -> list[Command]:
        if self.settings is not None:
            raise MalformedMessage("`websocket:connected` comes once")
        content_type = field(message, "content-type")
        match = CONTENT_TYPE.match(content_type)
        if match is None or int(match.group(1)) not in RATES:
            raise UnsupportedFormat(f"content-type {content_type!r} is not supported: use audio/l16;rate=8000, "
                                    "16000 or 24000")
        headers = {str(key): str(value) for key, value in message.items()
                   if key not in ("event", "content-type") and isinstance(value, (str, int, float, bool))}
        self.settings = stream_settings(self.defaults, self.limits, sample_rate=int(match.group(1)),
                                        encoding="s16le", num_tracks=1, parameters=headers)
        call_id = self.query.get("call_id") or next((headers[name] for name in CALL_ID_HEADERS if headers.get(name)),
                                                    None)
        metadata = {"content_type": content_type, "call_id_source": "given" if call_id else "generated"}
        self.call = self.calls.open(call_id or uuid.uuid4().hex, platform=self.PLATFORM, stream_id=uuid.uuid4().hex,
                                    tracks=(Track(0, TRACK),), parameters=headers, metadata=metadata)
        return [Start(self.settings)]

    def encode(self, event: events.ServerEvent) -> list[str | bytes]:
        """Events go to the call; Vonage would play binary frames sent back as audio, so nothing is sent."""
        if self.call is not None:
            self.call.event(event, 0)
        return []

    def close(self) -> None:
        if self.call is not None:
            self.call.close("hangup")
