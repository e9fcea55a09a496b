"""What the server allows every connection, whatever its stream asks for (stream limits: qasr.streaming.settings).

Frozen and validated once, here; `qasr-server` builds it from its command line.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    max_sessions: int = 64  # concurrent streams; one more is closed with 1013
    max_message_bytes: int = 1 << 20  # largest frame a client may send; larger ones close with 1009
    idle_timeout_s: float = 30.0  # seconds without a frame (or a ping) from the client before closing with 1008
    start_timeout_s: float = 10.0  # a new connection must send `start` this soon (1008), so idle sockets cannot
    # hold the session slots
    max_pending_finals: int = 16  # closed segments awaiting their final, per session; above it reading pauses
    drain_timeout_s: float = 30.0  # how long a stream closed by the server (SIGTERM, a fatal client error) may
    # still wait for its finals before the connection closes anyway
    send_timeout_s: float = 40.0  # a client that takes none of our frames this long (it stopped reading, or
    # vanished) is dropped: keepalive pings cannot reach it behind a full send buffer

    def __post_init__(self):
        _require(self.max_sessions >= 1, f"max_sessions must be >= 1, got {self.max_sessions}")
        _require(self.max_message_bytes >= 1024, f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        _require(self.idle_timeout_s > 0, f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        _require(self.start_timeout_s > 0, f"start_timeout_s must be > 0, got {self.start_timeout_s}")
        _require(self.max_pending_finals >= 1, f"max_pending_finals must be >= 1, got {self.max_pending_finals}")
        _require(self.drain_timeout_s >= 0, f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        _require(self.send_timeout_s > 0, f"send_timeout_s must be > 0, got {self.send_timeout_s}")

    def to_client(self) -> dict:
        """The connection limits a client may want to know (the native `ready` event adds the stream limits)."""
        return {"max_message_bytes": self.max_message_bytes, "idle_timeout_s": self.idle_timeout_s}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
