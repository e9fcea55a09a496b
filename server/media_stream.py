"""The media-stream family (Twilio Media Streams, Telnyx media streaming), sans-I/O: JSON text frames in, stream
commands out; the call's events go to the call registry, none back on the socket (both platforms ignore what a
one-way stream's server sends).

Both platforms send `connected`, then `start` (the call, its tracks and media format), then `media` frames (one
track's base64 payload of ~20 ms each, with `track`, `chunk` and `timestamp` in ms from the stream's start),
`dtmf` and finally `stop`. `TwilioAdapter` (server/twilio.py) and `TelnyxAdapter` (server/telnyx.py) spell out
their field names and formats; this module holds what they share:

- one track per channel of a multichannel stream (one session each, with its own VAD and timeline): the tracks'
  frames arrive interleaved and are lined up into [frames, tracks] blocks by `TrackAligner`;
- a track's timeline follows the platform's timestamps: a frame that starts more than `GAP_TOLERANCE_MS` after
  the audio received so far on its track (frames lost upstream) is preceded by silence; a track that lags the
  others by more than `MAX_TRACK_SKEW_MS` (it stopped sending) is padded with silence so the others' transcripts
  are not held up;
- `ReorderBuffer`, for platforms that do not guarantee frame order (Telnyx), puts messages back in sequence-number
  order within a bounded window.

Commands: `start` -> Start(settings) (channels = tracks, multichannel with two), `media` -> Audio, `stop` -> End.
A malformed frame (not JSON, a missing field, media before start, undecodable audio, another stream's id) closes
the connection with 1007; an unsupported media format with 1003; an unknown event is answered by an `error` event
to the call (Notice) and ignored.
"""

from __future__ import annotations

import binascii
import dataclasses
import logging

import numpy as np

from qasr.audio import AudioError, decode_pcm
from qasr.server.calls import CallRegistry, CallStream, Track
from qasr.server.commands import Audio, Command, End, Notice, Start
from qasr.server.errors import MalformedMessage, UnsupportedFormat
from qasr.server.languages import canonical_language
from qasr.server.wire_decode import b64decode, json_loads
from qasr.streaming import events
from qasr.streaming.settings import SettingsError, StreamLimits, StreamSettings

log = logging.getLogger("qasr.server")

GAP_TOLERANCE_MS = 10  # timestamp jitter tolerated before a gap is filled with silence (half a 20 ms frame)
MAX_TRACK_SKEW_MS = 500  # a track this far behind the others is padded: the others' latency is bounded by it
REORDER_WINDOW = 16  # messages held back while waiting for a missing sequence number (~160 ms of two tracks)
LANGUAGE_PARAMETER = "qasr_language"  # custom parameters that set the stream's language and decoder context
CONTEXT_PARAMETER = "qasr_context"


def parse_json(text: str) -> dict:
    try:
        message = json_loads(text)
    except (ValueError, RecursionError) as error:
        raise MalformedMessage(f"text frames must be JSON objects: {error}") from None
    if not isinstance(message, dict):
        raise MalformedMessage(f"text frames must be JSON objects, got {type(message).__name__}")
    return message


def field(message: dict, path: str, kind: type | tuple[type, ...] = str):
    """message["a"]["b"] for path "a.b", of type `kind`; MalformedMessage naming the path otherwise."""
    value = message
    for name in path.split("."):
        if not isinstance(value, dict) or name not in value:
            raise MalformedMessage(f"{message.get('event', 'message')}: {path} is missing")
        value = value[name]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise MalformedMessage(f"{message.get('event', 'message')}: {path} has the wrong type ({value!r})")
    return value


def number(message: dict, path: str) -> int:
    """A non-negative integer the platforms send as a decimal string ("chunk": "12") or a number."""
    value = field(message, path, (str, int))
    try:
        value = int(value)
    except ValueError:
        raise MalformedMessage(f"{message.get('event')}: {path} must be a whole number, got {value!r}") from None
    if value < 0:
        raise MalformedMessage(f"{message.get('event')}: {path} must be >= 0, got {value}")
    return value


def payload(message: dict) -> bytes:
    return b64decode_payload(field(message, "media.payload"))


def b64decode_payload(text: str) -> bytes:
    try:
        return b64decode(text)
    except (binascii.Error, ValueError) as error:
        raise MalformedMessage(f"media.payload is not base64: {error}") from None


def _usual_media(message: dict) -> tuple[str, str, int] | None:
    """(track, base64 payload, timestamp ms) of a `media` frame as the platforms send it (strings, the timestamp in
    ASCII digits), read without field()'s checks (4 per frame, 50 frames a second per track); None for any other
    shape, which then goes through the checks."""
    media = message.get("media")
    if type(media) is not dict:
        return None
    track, data, timestamp = media.get("track"), media.get("payload"), media.get("timestamp")
    if type(track) is str and type(data) is str and type(timestamp) is str and timestamp.isascii() \
            and timestamp.isdigit():
        return track, data, int(timestamp)
    return None


def stream_settings(defaults: StreamSettings, limits: StreamLimits, *, sample_rate: int, encoding: str,
                    num_tracks: int, parameters: dict[str, str]) -> StreamSettings:
    """The stream's settings: the server's defaults, the platform's format, and the language and context the
    call's custom parameters ask for. UnsupportedFormat (1003) for what this server cannot take."""
    changes = {"sample_rate": sample_rate, "encoding": encoding, "channels": num_tracks,
               "multichannel": num_tracks > 1}
    try:
        if parameters.get(LANGUAGE_PARAMETER):
            changes["language"] = canonical_language(parameters[LANGUAGE_PARAMETER])
        if CONTEXT_PARAMETER in parameters:
            changes["context"] = parameters[CONTEXT_PARAMETER]
        settings = dataclasses.replace(defaults, **changes)
        limits.check(settings)
    except SettingsError as error:
        raise UnsupportedFormat(f"{error.field}: {error}") from None
    except ValueError as error:  # an unknown language
        raise UnsupportedFormat(f"{LANGUAGE_PARAMETER}: {error}") from None
    return settings


def custom_parameters(value) -> dict[str, str]:
    """Custom parameters as an object {"name": "value"} (Twilio) or a list of {"name", "value"} (Telnyx's API)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(key): str(item) for key, item in value.items()}
    if isinstance(value, list) and all(isinstance(item, dict) and "name" in item for item in value):
        return {str(item["name"]): str(item.get("value", "")) for item in value}
    raise MalformedMessage(f"start: custom parameters must be an object, got {value!r}")


class TrackAligner:
    """Lines up tracks that arrive as separate frames into [frames, tracks] blocks, sample by sample.

    `push(track, samples, at)` places a track's samples at sample offset `at` of its timeline (None: right after
    what it had); a gap before `at` beyond `gap_tolerance` samples becomes silence. Blocks come out as soon as every
    track has the samples; a track more than `max_skew` samples behind the furthest one is padded with silence.
    """

    def __init__(self, num_tracks: int, *, gap_tolerance: int, max_skew: int):
        self.num_tracks = num_tracks
        self.gap_tolerance = gap_tolerance
        self.max_skew = max_skew
        self._pending: list[list[np.ndarray]] = [[] for _ in range(num_tracks)]
        self._received = [0] * num_tracks  # samples placed on each track's timeline (silence included)
        self._emitted = 0  # frames handed out (the same on every track)
        self.silence_inserted = [0] * num_tracks  # samples of silence each track was given

    def push(self, track: int, samples: np.ndarray, at: int | None = None) -> np.ndarray:
        """[n] float32 on `track` -> the [frames, tracks] block now complete (possibly 0 frames)."""
        if at is not None and at - self._received[track] > self.gap_tolerance:
            self._pad(track, at - self._received[track])
        if self.num_tracks == 1 and not self._pending[0] and samples.dtype == np.float32:
            self._received[0] += len(samples)  # one track, nothing held back: the frame is the block, as it is
            self._emitted = self._received[0]
            return samples.reshape(-1, 1)
        self._pending[track].append(samples)
        self._received[track] += len(samples)
        behind = max(self._received) - self.max_skew
        for other in range(self.num_tracks):
            if self._received[other] < behind:
                self._pad(other, behind - self._received[other])
        return self._take(min(self._received) - self._emitted)

    def position(self, track: int) -> int:
        """Samples on `track`'s timeline so far: where its next sample goes."""
        return self._received[track]

    def flush(self) -> np.ndarray:
        """Everything left, the shorter tracks padded with silence."""
        end = max(self._received)
        for track in range(self.num_tracks):
            if self._received[track] < end:
                self._pad(track, end - self._received[track])
        return self._take(end - self._emitted)

    def _pad(self, track: int, num_samples: int) -> None:
        self._pending[track].append(np.zeros(num_samples, np.float32))
        self._received[track] += num_samples
        self.silence_inserted[track] += num_samples

    def _take(self, num_frames: int) -> np.ndarray:
        block = np.empty((num_frames, self.num_tracks), np.float32)
        if num_frames == 0:
            return block
        for track, pending in enumerate(self._pending):
            joined = np.concatenate(pending) if len(pending) != 1 else pending[0]
            block[:, track] = joined[:num_frames]
            self._pending[track] = [joined[num_frames:]] if len(joined) > num_frames else []
        self._emitted += num_frames
        return block


class ReorderBuffer:
    """Messages back in sequence-number order. A missing number is waited for until `window` later messages are
    held; then it counts as lost and the rest go on. A number already passed (late or repeated) is dropped."""

    def __init__(self, window: int = REORDER_WINDOW):
        self.window = window
        self._held: dict[int, dict] = {}
        self._next: int | None = None
        self.lost = 0  # numbers given up on
        self.dropped = 0  # messages that came after their turn

    def push(self, sequence: int, message: dict) -> list[dict]:
        """One message -> the messages now in order (possibly none)."""
        if self._next is None:
            self._next = sequence
        if sequence < self._next or sequence in self._held:
            self.dropped += 1
            return []
        self._held[sequence] = message
        ready = self._release()
        while len(self._held) > self.window:  # the gap will not be filled: skip it
            missing = min(self._held) - self._next
            self.lost += missing
            self._next += missing
            ready += self._release()
        return ready

    def flush(self) -> list[dict]:
        """What is still held, in order (the stream ended)."""
        ready = [self._held[sequence] for sequence in sorted(self._held)]
        self._held.clear()
        return ready

    def _release(self) -> list[dict]:
        ready = []
        while self._next in self._held:
            ready.append(self._held.pop(self._next))
            self._next += 1
        return ready


@dataclasses.dataclass(frozen=True)
class MediaFormat:
    sample_rate: int  # Hz
    encoding: str  # qasr.audio.ENCODINGS name of the payload after base64 ("mulaw", "alaw", "s16le")
    big_endian: bool = False  # 16-bit payloads in network byte order (RTP L16)


class MediaStreamAdapter:
    """What Twilio and Telnyx share; subclasses name the fields (`_parse_start`) and the platform."""

    PLATFORM = "?"
    STREAM_ID_FIELD = "streamSid"
    SEQUENCE_FIELD = "sequenceNumber"
    finalise_on_disconnect = True  # a call dropped without `stop` still gets its open segments' finals

    def __init__(self, *, defaults: StreamSettings, limits: StreamLimits, calls: CallRegistry):
        self.defaults = defaults
        self.limits = limits
        self.calls = calls
        self.settings: StreamSettings | None = None
        self.stream_id: str | None = None
        self.call: CallStream | None = None
        self.format: MediaFormat | None = None
        self.tracks: dict[str, int] = {}  # the platform's track name -> channel
        self.aligner: TrackAligner | None = None
        self.ended = False

    # -- client -> server ------------------------------------------------------------------------------------

    def greeting(self) -> list[str | bytes]:
        return []

    def receive(self, message: str | bytes) -> list[Command]:
        if not isinstance(message, str):
            raise MalformedMessage(f"{self.PLATFORM} sends JSON text frames; got a binary frame")
        if self.ended:
            return []
        return self._handle(parse_json(message))

    def _handle(self, message: dict) -> list[Command]:
        """One message in arrival order (Telnyx reorders first)."""
        kind = message.get("event")
        if kind == "connected":
            return []
        if kind == "start":
            return self._start(message)
        if kind in ("media", "dtmf", "stop", "mark") and self.settings is None:
            raise MalformedMessage(f"`{kind}` before `start`")
        if kind in ("media", "dtmf", "stop", "mark"):
            stream_id = message.get(self.STREAM_ID_FIELD)
            if stream_id is not None and stream_id != self.stream_id:
                raise MalformedMessage(f"{kind}: {self.STREAM_ID_FIELD} {stream_id!r} is not this stream's "
                                       f"({self.stream_id!r})")
        if kind == "media":
            return self._media(message)
        if kind == "dtmf":
            self._dtmf(message)
            return []
        if kind == "mark":
            return []  # acknowledgements of marks a bidirectional stream's server sent; qasr sends none
        if kind == "stop":
            return self._stop()
        if kind is None:
            raise MalformedMessage('messages need an "event"')
        return [Notice("unknown_event", f"{self.PLATFORM}: ignored unknown event {str(kind)[:64]!r}")]

    def _start(self, message: dict) -> list[Command]:
        if self.settings is not None:
            raise MalformedMessage("the stream has already started: `start` comes once")
        call_id, stream_id, track_names, media_format, parameters, metadata = self._parse_start(message)
        if not call_id:  # the calls registry keys on it (found by the nightly fuzz: "" got through as a ValueError)
            raise MalformedMessage(f"{message.get('event', 'start')}: the call id is empty")
        self.format = media_format
        self.settings = stream_settings(self.defaults, self.limits, sample_rate=media_format.sample_rate,
                                        encoding=media_format.encoding, num_tracks=len(track_names),
                                        parameters=parameters)
        self.stream_id = stream_id
        self.tracks = {name: channel for channel, name in enumerate(track_names)}
        rate = media_format.sample_rate
        self.aligner = TrackAligner(len(track_names), gap_tolerance=GAP_TOLERANCE_MS * rate // 1000,
                                    max_skew=MAX_TRACK_SKEW_MS * rate // 1000)
        tracks = tuple(Track(channel, name, self.speaker(name)) for name, channel in self.tracks.items())
        self.call = self.calls.open(call_id, platform=self.PLATFORM, stream_id=stream_id, tracks=tracks,
                                    parameters=parameters, metadata=metadata)
        return [Start(self.settings)]

    def _media(self, message: dict) -> list[Command]:
        usual = _usual_media(message)
        if usual is not None:  # fields read once, no checks left that could fail: the same outcome, faster
            track, data, timestamp_ms = usual
            channel = self._channel(track)
            samples = self._decode(b64decode_payload(data))
        else:  # anything else: each field checked in turn, the first problem named
            channel = self._channel(field(message, "media.track"))
            samples = self._decode(payload(message))
            timestamp_ms = number(message, "media.timestamp") if "timestamp" in message.get("media", {}) else None
        at = None if timestamp_ms is None else timestamp_ms * self.format.sample_rate // 1000
        self.call.audio(len(samples) / self.format.sample_rate, channel)
        block = self.aligner.push(channel, samples, at)
        return [Audio(block)] if len(block) else []

    def _channel(self, track: str) -> int:
        name = self._track_name(track)
        if name not in self.tracks:
            raise MalformedMessage(f"media: track {name!r} is not one of this stream's tracks "
                                   f"({', '.join(self.tracks)})")
        return self.tracks[name]

    def _decode(self, data: bytes) -> np.ndarray:
        if self.format.big_endian:
            if len(data) % 2:
                raise MalformedMessage(f"media: 16-bit audio must have an even number of bytes, got {len(data)}")
            data = np.frombuffer(data, ">i2").astype("<i2").tobytes()
        try:
            return decode_pcm(data, self.format.encoding, 1)[:, 0]
        except AudioError as error:
            raise MalformedMessage(f"media: {error}") from None

    def _dtmf(self, message: dict) -> None:
        digit = field(message, "dtmf.digit")
        if len(digit) != 1 or digit not in "0123456789*#ABCDabcd":
            raise MalformedMessage(f"dtmf: {digit!r} is not a DTMF digit")
        track = field(message, "dtmf.track") if message["dtmf"].get("track") else self._dtmf_track()
        name = self._track_name(track)
        channel = self.tracks.get(name, 0)
        self.call.dtmf(digit.upper(), self.aligner.position(channel) / self.format.sample_rate, channel)

    def _stop(self) -> list[Command]:
        self.ended = True
        block = self.aligner.flush()
        return ([Audio(block)] if len(block) else []) + [End()]

    # -- server -> client ------------------------------------------------------------------------------------

    def encode(self, event: events.ServerEvent) -> list[str | bytes]:
        """Events go to the call (subscribers, webhooks); nothing goes back on the platform's socket."""
        if self.call is not None:
            self.call.event(event, getattr(event, "channel", 0) or 0)
        return []

    def close(self) -> None:
        """The connection is over (after `stop`, or without one): the call hears that this stream ended."""
        if self.call is not None:
            self.call.close("stop" if self.ended else "disconnected")
        if self.aligner is not None and any(self.aligner.silence_inserted):
            log.info("%s stream %s: silence inserted for lost or late audio: %s samples per track", self.PLATFORM,
                     self.stream_id, self.aligner.silence_inserted)

    # -- what each platform says its own way ------------------------------------------------------------------

    def _parse_start(self, message: dict) -> tuple[str, str, list[str], MediaFormat, dict, dict]:
        """-> (call id, stream id, track names in channel order, media format, custom parameters, metadata)."""
        raise NotImplementedError

    def _track_name(self, name: str) -> str:
        """The platform's spelling of a track -> the name its `start` listed ("inbound_track" -> "inbound")."""
        return name.removesuffix("_track")

    def _dtmf_track(self) -> str:
        return "inbound"  # the caller's keypad

    @staticmethod
    def speaker(track: str) -> str | None:
        """inbound: what the platform receives from the caller; outbound: what it sends them (the agent)."""
        return {"inbound": "caller", "outbound": "agent"}.get(track)
