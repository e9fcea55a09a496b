"""What can go wrong for a client, as exceptions that say what happened and what to do.

Hierarchy::

    ClientError                 base of everything qasr.client raises on purpose
    ├── ServerUnreachable       no stream could be opened: refused, unknown host, timeout, not a qasr endpoint
    ├── HandshakeRefused        the server answered the handshake with an HTTP error: .status, .message
    │   ├── AuthenticationFailed    401: no API key or token, or one the server does not accept
    │   ├── AccessDenied            403: not allowed from here (a browser Origin, a proxy's rule)
    │   ├── TooManyConnections      429: too many connections from this address (retryable)
    │   └── ServiceUnavailable      503: the server is loading its model or shutting down (retryable)
    ├── StreamClosed            the server ended the stream before it was complete: .code, .reason, .error
    │   └── ConnectionLost      the connection dropped without a close frame (1006): server killed, network gone
    ├── ProtocolMismatch        the server sent something this client cannot read
    └── AudioSourceError        the audio input failed: no microphone, PortAudio missing, unreadable file

`.retryable` (StreamClosed, ServerUnreachable, HandshakeRefused) says whether opening a new stream later may work
(the server restarted, was full or is still loading, had too many connections); `stream_audio(..., reconnect=N)`
retries those. A refused API key (AuthenticationFailed) never is.
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


class HandshakeRefused(ClientError):
    """The server (or a proxy in front of it) turned the connection away with an HTTP status before the WebSocket
    opened. status: the HTTP status; message: the server's reason (it never echoes the credential)."""

    retryable = False

    def __init__(self, description: str, status: int, message: str = ""):
        super().__init__(description)
        self.status = status
        self.message = message


class AuthenticationFailed(HandshakeRefused):
    """HTTP 401: the server requires an API key (or token) and got none, or one it does not accept. Retrying with
    the same credential cannot help. credential: what was sent ("api_key", "token" or None)."""

    def __init__(self, description: str, status: int, message: str = "", credential: str | None = None):
        super().__init__(description, status, message)
        self.credential = credential


class AccessDenied(HandshakeRefused):
    """HTTP 403: connections from here are not allowed (qasr: a browser Origin not in --allowed-origins)."""


class TooManyConnections(HandshakeRefused):
    """HTTP 429: too many connections from this address are open or still connecting; later may work."""

    retryable = True


class ServiceUnavailable(HandshakeRefused):
    """HTTP 503: the server cannot take a stream now (its model is still loading, or it is shutting down); another
    replica, or this one later, will."""

    retryable = True


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
