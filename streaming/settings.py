"""One stream's settings, declared once: what a client may choose, the defaults, and what the server allows.

    defaults = StreamSettings(partial_interval_ms=500)               # the server's defaults (from its flags)
    settings = dataclasses.replace(defaults, sample_rate=8000,       # what one client asked for
                                   vad=dataclasses.replace(defaults.vad, end_silence_ms=300))
    limits.check(settings)                                           # what this server allows

Every wire adapter builds a stream's settings this way from its own format. Each value is checked once, when the
object is made (types and the ranges that hold on any server), and `StreamLimits.check` adds this server's limits;
both raise `SettingsError` naming the field as clients spell it ("vad.max_segment_s"). Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qasr.audio import ENCODINGS
from qasr.streaming.resample import MAX_RATE as MAX_SAMPLE_RATE
from qasr.streaming.resample import MIN_RATE as MIN_SAMPLE_RATE


class SettingsError(ValueError):
    """A setting that cannot be honoured; `field` names it as clients spell it (e.g. "vad.max_segment_s")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class VadSettings:
    """How a stream is cut into speech segments (qasr.streaming.vad)."""

    aggressiveness: int = 2  # webrtcvad 0 (keeps most audio) .. 3 (drops most non-speech)
    end_silence_ms: int = 500  # silence that closes a segment (100..5000)
    pre_roll_ms: int = 300  # audio kept before the detected onset (0..2000); the VAD uses at most a quarter of
    # max_segment_s of it, so that a segment opening on silence still has room for speech
    max_segment_s: float = 30.0  # longer speech is cut at its quietest point (1..limits.max_segment_s)

    def __post_init__(self) -> None:
        _check_int("vad.aggressiveness", self.aggressiveness, 0, 3)
        _check_int("vad.end_silence_ms", self.end_silence_ms, 100, 5000)
        _check_int("vad.pre_roll_ms", self.pre_roll_ms, 0, 2000)
        _check_number("vad.max_segment_s", self.max_segment_s, 1.0, math.inf)


@dataclass(frozen=True)
class StreamSettings:
    """Everything about one stream that a client may choose; the defaults are the server's unless its flags say
    otherwise."""

    sample_rate: int = 16000  # Hz of the audio the client sends
    encoding: str = "s16le"  # qasr.audio.ENCODINGS: "s16le", "f32le", "mulaw", "alaw"
    channels: int = 1  # interleaved
    multichannel: bool = False  # False: channels averaged to mono; True: each channel segmented and transcribed
    # on its own (qasr.streaming.multichannel), its events carrying `channel`
    language: str | None = None  # canonical language name; None: the model detects it
    context: str = ""  # decoder hints (names, topic, spelling)
    partials: bool = True  # send hypotheses while a segment grows
    partial_interval_ms: int = 1000  # a partial is due after this much new segment audio
    vad: VadSettings = field(default_factory=VadSettings)
    words: bool = False  # word times on finals (issue #17; refused while no aligner is loaded)

    def __post_init__(self) -> None:
        _check_int("sample_rate", self.sample_rate, MIN_SAMPLE_RATE, MAX_SAMPLE_RATE)
        if self.encoding not in ENCODINGS:
            raise SettingsError("encoding", f"encoding {self.encoding!r} is not supported: use "
                                            f"{', '.join(ENCODINGS)}")
        _check_int("channels", self.channels, 1, math.inf)
        _check_bool("multichannel", self.multichannel)
        if self.language is not None and (not isinstance(self.language, str) or not self.language.strip()):
            raise SettingsError("language", f"language must be a language name or null, got {self.language!r}")
        if not isinstance(self.context, str):
            raise SettingsError("context", f"context must be a string, got {self.context!r}")
        _check_bool("partials", self.partials)
        _check_int("partial_interval_ms", self.partial_interval_ms, 1, math.inf)
        if not isinstance(self.vad, VadSettings):
            raise SettingsError("vad", f"vad must be VadSettings, got {type(self.vad).__name__}")
        _check_bool("words", self.words)

    @property
    def bytes_per_frame(self) -> int:
        """Bytes of one sample on every channel, on the wire."""
        return ENCODINGS[self.encoding] * self.channels


@dataclass(frozen=True)
class StreamLimits:
    """What this server lets a client ask for; `check` is the one place a stream's settings are held to it."""

    min_sample_rate: int = MIN_SAMPLE_RATE  # Hz
    max_sample_rate: int = MAX_SAMPLE_RATE  # Hz
    max_channels: int = 8
    min_partial_interval_ms: int = 200  # partials more often than this would only queue up
    max_partial_interval_ms: int = 10_000
    max_context_chars: int = 2000  # `context` becomes decoder prompt tokens: keep it bounded
    max_segment_s: float = 30.0  # the longest segment a client may ask the VAD for (the model hears <= 30 s)
    word_times: bool = False  # an aligner is loaded: finals may carry word times

    def __post_init__(self) -> None:
        _require(MIN_SAMPLE_RATE <= self.min_sample_rate <= self.max_sample_rate <= MAX_SAMPLE_RATE,
                 f"need {MIN_SAMPLE_RATE} <= min_sample_rate <= max_sample_rate <= {MAX_SAMPLE_RATE}, got "
                 f"{self.min_sample_rate}, {self.max_sample_rate}")
        _require(self.max_channels >= 1, f"max_channels must be >= 1, got {self.max_channels}")
        _require(0 < self.min_partial_interval_ms <= self.max_partial_interval_ms,
                 "need 0 < min_partial_interval_ms <= max_partial_interval_ms")
        _require(self.max_context_chars >= 0, f"max_context_chars must be >= 0, got {self.max_context_chars}")
        _require(self.max_segment_s >= 1.0, f"max_segment_s must be >= 1, got {self.max_segment_s}")

    def check(self, settings: StreamSettings) -> None:
        """Raise SettingsError for the first setting over this server's limits."""
        _check_int("sample_rate", settings.sample_rate, self.min_sample_rate, self.max_sample_rate)
        _check_int("channels", settings.channels, 1, self.max_channels)
        _check_int("partial_interval_ms", settings.partial_interval_ms, self.min_partial_interval_ms,
                   self.max_partial_interval_ms)
        if len(settings.context) > self.max_context_chars:
            raise SettingsError("context", f"context has {len(settings.context)} characters; the limit is "
                                           f"{self.max_context_chars}")
        _check_number("vad.max_segment_s", settings.vad.max_segment_s, 1.0, self.max_segment_s)
        if settings.words and not self.word_times:
            raise SettingsError("words", "word times are not available: this server has no aligner loaded")

    def to_client(self) -> dict:
        """The limits a client may want to know (the native protocol's `ready` event carries them)."""
        return {
            "sample_rates": [self.min_sample_rate, self.max_sample_rate],
            "max_channels": self.max_channels,
            "partial_interval_ms": [self.min_partial_interval_ms, self.max_partial_interval_ms],
            "max_context_chars": self.max_context_chars,
            "max_segment_s": self.max_segment_s,
            "words": self.word_times,
        }


def _check_int(name: str, value, low, high) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingsError(name, f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise SettingsError(name, f"{name} must be {_range(low, high)}, got {value}")


def _check_number(name: str, value, low, high) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SettingsError(name, f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise SettingsError(name, f"{name} must be {_range(low, high)}, got {value:g}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise SettingsError(name, f"{name} must be true or false, got {value!r}")


def _range(low, high) -> str:
    return f">= {low:g}" if high == math.inf else f"between {low:g} and {high:g}"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
