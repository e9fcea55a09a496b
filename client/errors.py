"""What can go wrong for a client, as exceptions that say what happened and what to do.

Hierarchy::

    ClientError                 base of everything qasr.client raises on purpose
    ├── ServerUnreachable       no stream could be opened: refused, unknown host, timeout, not a qasr endpoint
    ├── StreamClosed            the server ended the stream before it was complete: .code, .reason, .error
    │   └── ConnectionLost      the connection dropped without a close frame (1006): server killed, network gone
    ├── ProtocolMismatch        the server sent something this client cannot read
    └── AudioSourceError        the audio input failed: no microphone, PortAudio missing, unreadable file

`StreamClosed.retryable` says whether opening a new stream later may work (the server restarted, was full or is
still loading); `stream_audio(..., reconnect=N)` retries those.
"""

from __future__ import annotations

from qasr.streaming.events import Error

NORMAL_CLOSURE = 1000
GOING_AWAY = 1001
ABNORMAL_CLOSURE = 1006  # no close frame: the TCP connection just ended
TRY_AGAIN_LATER = 1013
RETRYABLE_CODES = frozenset({GOING_AWAY, ABNORMAL_CLOSURE, TRY_AGAIN_LATER})


class ClientError(Exception):
    """Base class of qasr.client's exceptions."""


class ServerUnreachable(ClientError):
    """No stream could be opened at the URL (the server is not running, not listening there, or not qasr)."""

    retryable = True  # a server that is restarting becomes reachable again


class StreamClosed(ClientError):
    """The server closed the stream before the client's `end` was answered with a summary.

    code: the WebSocket close code (1001 shutting down, 1003/1007 bad input, 1008 idle, 1011 server fault,
    1013 full or loading, 1006 connection lost); reason: the close frame's reason; error: the fatal `error` event
    the server sent before closing, if any.
    """

    def __init__(self, code: int, reason: str = "", error: Error | None = None):
        self.code = code
        self.reason = reason
        self.error = error
        super().__init__(self._describe())

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES

    def _describe(self) -> str:
        detail = self.error.message if self.error is not None else self.reason
        what = "the server is shutting down" if self.code == GOING_AWAY else "the server closed the stream"
        return f"{what} (close code {self.code}{': ' + detail if detail else ''})"


class ConnectionLost(StreamClosed):
    """The connection ended without a close frame: the server process died or the network went away."""

    def __init__(self, reason: str = ""):
        super().__init__(ABNORMAL_CLOSURE, reason)

    def _describe(self) -> str:
        return "the connection to the server was lost" + (f" ({self.reason})" if self.reason else "")


class ProtocolMismatch(ClientError):
    """A frame from the server this client cannot understand (a different protocol version, or not qasr)."""


class AudioSourceError(ClientError):
    """The audio input cannot be used: no (such) microphone, no PortAudio library, an unreadable file."""
