"""Twilio Media Streams (`<Start><Stream>` or `<Connect><Stream>`), sans-I/O; served at `/v1/twilio`.

The messages implemented (Twilio's documented shapes; every one after `connected` carries `sequenceNumber`, a
decimal string counting from 1, and `streamSid`):

    {"event": "connected", "protocol": "Call", "version": "1.0.0"}
    {"event": "start", "sequenceNumber": "1", "streamSid": "MZ...",
     "start": {"streamSid": "MZ...", "accountSid": "AC...", "callSid": "CA...",
               "tracks": ["inbound", "outbound"],                  (both_tracks; or one of them)
               "customParameters": {"name": "value", ...},          (<Parameter> elements)
               "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}
    {"event": "media", "sequenceNumber": "3", "streamSid": "MZ...",
     "media": {"track": "inbound", "chunk": "2", "timestamp": "20", "payload": "<base64 mu-law, 20 ms>"}}
    {"event": "dtmf", "sequenceNumber": "9", "streamSid": "MZ...", "dtmf": {"track": "inbound_track", "digit": "5"}}
    {"event": "mark", "sequenceNumber": "10", "streamSid": "MZ...", "mark": {"name": "..."}}
    {"event": "stop", "sequenceNumber": "11", "streamSid": "MZ...", "stop": {"accountSid": "AC...", "callSid": "CA..."}}

The call id is `callSid`; `inbound` (the caller) is channel 0 and `outbound` (the agent) channel 1. Twilio delivers
in order over one TCP connection, sends no pings, and reads nothing a one-way stream's server sends: a frame that
breaks the protocol closes the connection (1007; 1003 for a media format other than 8 kHz mu-law), which Twilio
reports in its debugger. A `sequenceNumber` that does not increase (a repeat) is dropped with a notice to the
call; a jump is accepted (the timestamps place the audio that follows).
"""

from __future__ import annotations

from qasr.server.commands import Command, Notice
from qasr.server.errors import MalformedMessage, UnsupportedFormat
from qasr.server.media_stream import MediaFormat, MediaStreamAdapter, custom_parameters, field, number

TRACKS = ("inbound", "outbound")  # in channel order


class TwilioAdapter(MediaStreamAdapter):
    PLATFORM = "twilio"
    STREAM_ID_FIELD = "streamSid"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._last_sequence = 0

    def _handle(self, message: dict) -> list[Command]:
        if message.get("event") != "connected" and "sequenceNumber" in message:
            sequence = message["sequenceNumber"]  # ASCII digits from Twilio (read directly), else checked
            sequence = int(sequence) if type(sequence) is str and sequence.isascii() and sequence.isdigit() \
                else number(message, "sequenceNumber")
            if sequence <= self._last_sequence:
                return [Notice("out_of_order", f"twilio: dropped {message.get('event')} message with sequenceNumber "
                                               f"{sequence} after {self._last_sequence}")]
            self._last_sequence = sequence
        return super()._handle(message)

    def _parse_start(self, message: dict):
        start = field(message, "start", dict)
        call_id = field(message, "start.callSid")
        stream_id = field(message, "streamSid") if message.get("streamSid") else field(message, "start.streamSid")
        tracks = field(message, "start.tracks", list)
        names = [name for name in TRACKS if name in tracks]
        if not names or len(names) != len(tracks):
            raise MalformedMessage(f"start: tracks must be inbound, outbound or both, got {tracks!r}")
        media_format = field(message, "start.mediaFormat", dict)
        encoding, rate, channels = (media_format.get("encoding"), media_format.get("sampleRate"),
                                    media_format.get("channels", 1))
        if encoding != "audio/x-mulaw" or rate != 8000 or channels != 1:
            raise UnsupportedFormat(f"start: mediaFormat {encoding} {rate} Hz x{channels} is not supported: Twilio "
                                    "streams audio/x-mulaw at 8000 Hz, one channel per track")
        metadata = {"account_sid": start.get("accountSid"), "call_sid": call_id, "media_format": media_format}
        return (call_id, stream_id, names, MediaFormat(8000, "mulaw"),
                custom_parameters(start.get("customParameters")), metadata)
