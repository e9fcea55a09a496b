"""Telnyx media streaming (Call Control `streaming_start`, TeXML `<Stream>`), sans-I/O; served at `/v1/telnyx`.

The messages implemented (Telnyx's documented shapes; `sequence_number` is a decimal string counting from 1 with
`start`; media payloads are RTP payloads without headers):

    {"event": "connected", "version": "1.0.0"}
    {"event": "start", "sequence_number": "1", "stream_id": "32de...",
     "start": {"user_id": "...", "call_control_id": "v3:...", "call_session_id": "...", "client_state": "...",
               "from": "+1...", "to": "+1...", "tracks": ["inbound", "outbound"],     (both_tracks; optional)
               "custom_parameters": {...} or [{"name": ..., "value": ...}],      (optional)
               "media_format": {"encoding": "PCMU", "sample_rate": 8000, "channels": 1}}}
    {"event": "media", "sequence_number": "4", "stream_id": "32de...",
     "media": {"track": "inbound", "chunk": "2", "timestamp": "20", "payload": "<base64>"}}
    {"event": "dtmf", "sequence_number": "5", "stream_id": "32de...", "dtmf": {"digit": "1"}}
    {"event": "error", "sequence_number": "6", "stream_id": "32de...", "payload": {"code": 100002, "title": ...}}
    {"event": "stop", "sequence_number": "7", "stream_id": "32de...", "stop": {"call_control_id": "v3:..."}}

Encodings: PCMU and PCMA (8 kHz), L16 (16-bit linear in network byte order, as RTP carries it, at the given
`sample_rate`); G722, OPUS and AMR-WB are refused (1003). The call id is `call_control_id`.

Telnyx does not guarantee frame order: messages are put back in `sequence_number` order (`ReorderBuffer`, a window
of 16 messages); one that comes after its turn is dropped, a number still missing when the window is full counts
as lost (the next frame's timestamp places the audio after it). Messages that arrive before `start` are held in
the same window. Telnyx's own `error` events are passed to the call as `error` events. Malformed frames close
the connection with 1007.
"""

from __future__ import annotations

from qasr.server.commands import Command, Notice
from qasr.server.errors import MalformedMessage, UnsupportedFormat
from qasr.server.media_stream import (REORDER_WINDOW, MediaFormat, MediaStreamAdapter, ReorderBuffer,
                                      custom_parameters, field, number)

ENCODINGS = {"PCMU": "mulaw", "PCMA": "alaw", "L16": "s16le"}
TRACKS = ("inbound", "outbound")


class TelnyxAdapter(MediaStreamAdapter):
    PLATFORM = "telnyx"
    STREAM_ID_FIELD = "stream_id"

    def __init__(self, *, reorder_window: int = REORDER_WINDOW, **kwargs):
        super().__init__(**kwargs)
        self.reorder = ReorderBuffer(reorder_window)
        self._before_start: list[tuple[int, dict]] = []  # frames that overtook `start`

    def _handle(self, message: dict) -> list[Command]:
        if "sequence_number" not in message or message.get("event") == "connected":
            return super()._handle(message)
        sequence = number(message, "sequence_number")
        if message.get("event") == "start":
            commands = super()._handle(message)
            self.reorder.push(sequence, message)  # the order starts here
            for held_sequence, held in sorted(self._before_start, key=lambda item: item[0]):
                commands += self._in_order(self.reorder.push(held_sequence, held))
            self._before_start.clear()
            return commands
        if self.settings is None:
            self._before_start.append((sequence, message))
            if len(self._before_start) > self.reorder.window:
                raise MalformedMessage(f"{len(self._before_start)} messages before `start`")
            return []
        if message.get("event") == "stop":
            return self._in_order(self.reorder.push(sequence, message) + self.reorder.flush())
        dropped = self.reorder.dropped
        commands = self._in_order(self.reorder.push(sequence, message))
        if self.reorder.dropped > dropped:
            commands.append(Notice("out_of_order", f"telnyx: dropped {message.get('event')} message "
                                                   f"{sequence}: it came after its turn"))
        return commands

    def _in_order(self, messages: list[dict]) -> list[Command]:
        commands = []
        for message in messages:
            if self.ended:
                break
            if message.get("event") == "error":
                details = message.get("payload") if isinstance(message.get("payload"), dict) else {}
                commands.append(Notice("platform_error", f"telnyx: {details.get('title', 'error')}: "
                                                         f"{details.get('detail', '')}".strip(": ")))
                continue
            commands += super()._handle(message)
        return commands

    def _parse_start(self, message: dict):
        start = field(message, "start", dict)
        call_id = field(message, "start.call_control_id")
        stream_id = message.get("stream_id") or start.get("stream_id")
        if not isinstance(stream_id, str) or not stream_id:
            raise MalformedMessage("start: stream_id is missing")
        tracks = start.get("tracks", ["inbound"])
        if not isinstance(tracks, list):
            raise MalformedMessage(f"start: tracks must be a list, got {tracks!r}")
        names = [name for name in TRACKS if name in tracks or f"{name}_track" in tracks]
        if not names or len(names) != len(tracks):
            raise MalformedMessage(f"start: tracks must be inbound, outbound or both, got {tracks!r}")
        media_format = field(message, "start.media_format", dict)
        encoding, rate = media_format.get("encoding"), media_format.get("sample_rate")
        if encoding not in ENCODINGS:
            raise UnsupportedFormat(f"start: media encoding {encoding!r} is not supported: use "
                                    f"{', '.join(ENCODINGS)}")
        if isinstance(rate, str) and rate.isdigit():
            rate = int(rate)
        if encoding != "L16" and rate not in (None, 8000):
            raise UnsupportedFormat(f"start: {encoding} is 8000 Hz, got sample_rate {rate!r}")
        if encoding == "L16" and (isinstance(rate, bool) or not isinstance(rate, int)):
            raise MalformedMessage(f"start: L16 needs an integer sample_rate, got {rate!r}")
        if media_format.get("channels", 1) not in (1, "1"):
            raise UnsupportedFormat(f"start: {media_format.get('channels')} channels per track are not supported")
        metadata = {key: start[key] for key in ("call_session_id", "call_leg_id", "from", "to", "client_state")
                    if key in start}
        metadata["media_format"] = media_format
        return (call_id, stream_id, names, MediaFormat(rate or 8000, ENCODINGS[encoding], big_endian=encoding == "L16"),
                custom_parameters(start.get("custom_parameters")), metadata)
