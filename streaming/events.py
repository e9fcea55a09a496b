"""What a stream tells its client: the server events of the native protocol, as plain values.

A `Session` produces `SpeechStarted`, `SpeechEnded`, `Partial`, `Final`, `Error` and `Summary`; the server adds
`Ready` and fatal `Error`s. Wire adapters (`qasr.server.protocol` for the native protocol) turn them into frames
(zero or more each: the native protocol sends nothing for `SpeechEnded`), so nothing here knows about JSON, msgpack
or sockets. Times are seconds from the start of the stream.

On a multichannel stream (`StreamSettings.multichannel`) each channel is segmented on its own: the events of a
channel's segments (and its decode failures) carry `channel`, its index; segment ids count per channel. `channel` is
None on every other stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Union


@dataclass(frozen=True)
class Ready:
    TYPE: ClassVar[str] = "ready"
    session_id: str
    model: str
    sample_rate: int  # the client's declared input rate
    engine_sample_rate: int  # the rate the model hears (audio is resampled to it)
    limits: dict = field(default_factory=dict)  # the server limits in force for this session
    config: dict = field(default_factory=dict)  # the stream's settings: the start message with defaults filled in


@dataclass(frozen=True)
class SpeechStarted:
    TYPE: ClassVar[str] = "speech_started"
    segment_id: int
    start: float  # seconds: where the segment begins (pre-roll included)
    channel: int | None = None  # multichannel streams: whose segment


@dataclass(frozen=True)
class SpeechEnded:
    """The VAD closed a segment: its final is being decoded (wire protocols that announce the end of speech use it)."""

    TYPE: ClassVar[str] = "speech_ended"
    segment_id: int
    end: float  # seconds: where the segment ends
    channel: int | None = None  # multichannel streams: whose segment


@dataclass(frozen=True)
class Partial:
    TYPE: ClassVar[str] = "partial"
    segment_id: int
    text: str  # the hypothesis so far; may change, replaced by the next partial or the final
    language: str  # canonical language name, "" when the model heard no speech
    start: float  # seconds
    end: float  # seconds: the end of the audio this hypothesis heard
    channel: int | None = None  # multichannel streams: whose segment


@dataclass(frozen=True)
class Word:
    """One word of a final, timed by the forced aligner: seconds from the start of the stream."""

    word: str
    start: float
    end: float


@dataclass(frozen=True)
class Final:
    TYPE: ClassVar[str] = "final"
    segment_id: int
    text: str
    language: str
    start: float  # seconds
    end: float  # seconds
    reason: str  # why the segment closed: "silence", "max_length", "flush", "end", ...
    latency_ms: float  # from the decision that the segment ended to this event being handed out
    channel: int | None = None  # multichannel streams: whose segment
    words: tuple[Word, ...] | None = None  # streams that asked for word times (StreamSettings.words): the words in
    # order, inside [start, end]; None on every other stream (the wire then has no `words`)
    words_reason: str | None = None  # asked for words and there are none: why (e.g. a language the aligner does not
    # support, a segment without words)


@dataclass(frozen=True)
class Error:
    TYPE: ClassVar[str] = "error"
    code: str  # stable, machine-readable: "malformed", "unsupported", "decode_failed", ...
    message: str  # for people; never carries internal details
    fatal: bool = False  # True: the server closes the connection after this event (and any finals due)
    channel: int | None = None  # multichannel streams: the channel whose segment failed (None: the stream's)


@dataclass(frozen=True)
class Summary:
    TYPE: ClassVar[str] = "summary"
    segments: int  # segments finalised (one final each; every channel's on a multichannel stream)
    audio_seconds: float  # audio received, at the input rate (the stream's length, not summed over channels)
    speech_seconds: float  # total length of the segments (summed over channels)


ServerEvent = Union[Ready, SpeechStarted, SpeechEnded, Partial, Final, Error, Summary]
