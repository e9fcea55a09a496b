"""What the server allows a client, and what a stream gets when its `start` message leaves a field out.

Both are frozen and validated once, here; `qasr-server` builds them from its command line.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    max_sessions: int = 64  # concurrent streams; one more is closed with 1013
    max_message_bytes: int = 1 << 20  # largest frame a client may send; larger ones close with 1009
    idle_timeout_s: float = 30.0  # seconds without a frame from the client before closing with 1008
    start_timeout_s: float = 10.0  # a new connection must send `start` this soon (1008), so idle sockets cannot
    # hold the session slots
    min_sample_rate: int = 8000  # Hz
    max_sample_rate: int = 192000  # Hz
    max_channels: int = 8  # channels are averaged down to mono
    min_partial_interval_ms: int = 200  # partials more often than this would only queue up
    max_partial_interval_ms: int = 10_000
    max_context_chars: int = 2000  # `context` becomes decoder prompt tokens: keep it bounded
    max_segment_s: float = 30.0  # the longest segment a client may ask the VAD for (the model hears <= 30 s)
    max_pending_finals: int = 16  # closed segments awaiting their final, per session; above it reading pauses
    drain_timeout_s: float = 30.0  # how long a stream closed by the server (SIGTERM, a fatal client error) may
    # still wait for its finals before the connection closes anyway

    def __post_init__(self):
        _require(self.max_sessions >= 1, f"max_sessions must be >= 1, got {self.max_sessions}")
        _require(self.max_message_bytes >= 1024, f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        _require(self.idle_timeout_s > 0, f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        _require(self.start_timeout_s > 0, f"start_timeout_s must be > 0, got {self.start_timeout_s}")
        _require(0 < self.min_sample_rate <= self.max_sample_rate,
                 f"need 0 < min_sample_rate <= max_sample_rate, got {self.min_sample_rate}, {self.max_sample_rate}")
        _require(self.max_channels >= 1, f"max_channels must be >= 1, got {self.max_channels}")
        _require(0 < self.min_partial_interval_ms <= self.max_partial_interval_ms,
                 "need 0 < min_partial_interval_ms <= max_partial_interval_ms")
        _require(self.max_segment_s >= 1.0, f"max_segment_s must be >= 1, got {self.max_segment_s}")
        _require(self.max_pending_finals >= 1, f"max_pending_finals must be >= 1, got {self.max_pending_finals}")
        _require(self.drain_timeout_s >= 0, f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")

    def to_client(self) -> dict:
        """The limits a client may want to know, as sent in the `ready` event."""
        return {
            "max_message_bytes": self.max_message_bytes,
            "idle_timeout_s": self.idle_timeout_s,
            "sample_rates": [self.min_sample_rate, self.max_sample_rate],
            "max_channels": self.max_channels,
            "partial_interval_ms": [self.min_partial_interval_ms, self.max_partial_interval_ms],
            "max_context_chars": self.max_context_chars,
            "max_segment_s": self.max_segment_s,
        }


@dataclass(frozen=True)
class StreamDefaults:
    """Values for the fields a `start` message leaves out."""

    partials: bool = True
    partial_interval_ms: int = 1000  # a new partial after this much new speech
    vad_aggressiveness: int = 2  # webrtcvad 0 (lenient) .. 3 (strict)
    end_silence_ms: int = 500  # silence that closes a segment
    pre_roll_ms: int = 300  # audio kept before the detected speech start
    max_segment_s: float = 30.0  # longer speech is cut at the quietest point

    def __post_init__(self):
        _require(0 <= self.vad_aggressiveness <= 3, f"vad_aggressiveness must be 0..3, got {self.vad_aggressiveness}")
        _require(self.partial_interval_ms > 0, f"partial_interval_ms must be > 0, got {self.partial_interval_ms}")
        _require(self.end_silence_ms > 0, f"end_silence_ms must be > 0, got {self.end_silence_ms}")
        _require(self.pre_roll_ms >= 0, f"pre_roll_ms must be >= 0, got {self.pre_roll_ms}")
        _require(self.max_segment_s >= 1.0, f"max_segment_s must be >= 1, got {self.max_segment_s}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
