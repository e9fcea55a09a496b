"""Why a connection ends, and the one place that turns any exception into a close code.

Hierarchy::

    ServerError                     carries a WebSocket close code and a stable error code for clients
    ├── ProtocolError               the client broke the native protocol
    │   ├── MalformedMessage        1007  bad JSON, unknown type, partial sample, audio before start, bad value
    │   ├── UnsupportedFormat       1003  sample rate, encoding, channels, format or language we cannot take
    │   └── MessageTooBig           1009  a frame over the size limit (websockets enforces it on the socket)
    ├── IdleTimeout                 1008  no frame from the client for too long
    ├── ServerFull                  1013  max sessions reached
    ├── NotReady                    1013  the engine is still loading
    ├── ShuttingDown                1001  the server is stopping
    └── EngineStopped               1001 while the server stops, else 1011: the engine closed under the stream

Anything else that escapes a connection is an internal error: 1011, logged with its traceback, and the client
only hears "internal server error". A client that goes away (websockets' ConnectionClosed) is no error at all.
When the connection still works (a client's fatal mistake, an idle timeout, a shutdown), the stream is finalised
before closing: the `error` event first, then the finals of its open segments, the summary, then the close.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from websockets.exceptions import ConnectionClosed

log = logging.getLogger("qasr.server")

NORMAL = 1000
GOING_AWAY = 1001
UNSUPPORTED_DATA = 1003
INVALID_DATA = 1007
POLICY_VIOLATION = 1008
MESSAGE_TOO_BIG = 1009
INTERNAL_ERROR = 1011
TRY_AGAIN_LATER = 1013


class ServerError(Exception):
    close_code: int = INTERNAL_ERROR
    error_code: str = "internal"


class ProtocolError(ServerError):
    """The client sent something the native protocol does not allow."""


class MalformedMessage(ProtocolError):
    close_code = INVALID_DATA
    error_code = "malformed"


class UnsupportedFormat(ProtocolError):
    close_code = UNSUPPORTED_DATA
    error_code = "unsupported"


class MessageTooBig(ProtocolError):
    close_code = MESSAGE_TOO_BIG
    error_code = "message_too_big"


class IdleTimeout(ServerError):
    close_code = POLICY_VIOLATION
    error_code = "idle_timeout"


class ServerFull(ServerError):
    close_code = TRY_AGAIN_LATER
    error_code = "server_full"


class NotReady(ServerError):
    close_code = TRY_AGAIN_LATER
    error_code = "not_ready"


class ShuttingDown(ServerError):
    close_code = GOING_AWAY
    error_code = "going_away"


class EngineStopped(ServerError):
    """The engine closed under a stream (qasr.server.stream_runner turns the engine's EngineClosed into this, so
    the wire adapters that raise these errors need nothing of the engine)."""


@dataclass(frozen=True)
class CloseDecision:
    close_code: int
    error_code: str  # for the `error` event and the metrics
    message: str  # safe to send to the client
    finalise: bool  # the connection still works: the stream's open segments get their finals before it closes


def decide_close(exc: BaseException, *, stopping: bool = False) -> CloseDecision | None:
    """How a connection ends because of `exc`; None when the client is gone and nothing can be sent.

    `stopping`: the server is shutting down, so an engine that closed under us means "going away", not a fault.
    """
    if isinstance(exc, ConnectionClosed):
        return None
    if isinstance(exc, EngineStopped) and stopping:
        return CloseDecision(GOING_AWAY, ShuttingDown.error_code, "server is shutting down", False)
    if isinstance(exc, ServerError) and not isinstance(exc, EngineStopped):
        finalise = isinstance(exc, (ProtocolError, IdleTimeout, ShuttingDown))
        return CloseDecision(exc.close_code, exc.error_code, str(exc) or exc.error_code, finalise)
    log.error("internal error in a connection", exc_info=exc)
    return CloseDecision(INTERNAL_ERROR, "internal", "internal server error", False)

