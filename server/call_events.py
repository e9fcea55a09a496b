"""`GET /v1/calls/{call_id}/events`: a WebSocket that follows one call's messages (qasr.server.calls draws them).

The integrator's application, not the telephony platform, connects here. It sends nothing (what it sends is read and
ignored, so that its close is noticed); the server sends each call message as one JSON text frame: first what the
call said since its start (the registry's replay), then live messages, and closes once the call has ended:

    1000  after `call_ended`
    1001  the server is stopping (after the call's remaining messages, within the drain timeout)
    1008  the subscriber fell too far behind (CallOptions.subscriber_queue messages) and was dropped
    1013  no room for another call record (CallsFull): try again later

A subscriber may connect before the call starts (the call is then awaited), during it, or up to the registry's
retention after it ended. The path passes the same handshake gate as the stream paths (origin, address limits, API
key) and counts against no stream limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from typing import Collection, Iterator
from urllib.parse import unquote, urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from qasr.server import errors
from qasr.server.calls import CallRegistry, CallsFull

log = logging.getLogger("qasr.calls")

CALL_EVENTS_PATH = "/v1/calls/{call_id}/events"
_CALL_EVENTS = re.compile(r"^/v1/calls/([^/]+)/events$")
MAX_CALL_ID_CHARS = 256


def call_id_of(path: str) -> str | None:
    """The call id a subscriber path names (percent-decoded), None for any other path."""
    match = _CALL_EVENTS.match(urlsplit(path).path)
    if match is None:
        return None
    call_id = unquote(match.group(1))
    return call_id if 0 < len(call_id) <= MAX_CALL_ID_CHARS else None


class WebSocketPaths(Collection[str]):
    """The paths that upgrade to a WebSocket: the wire adapters' fixed paths plus every subscriber path. What the
    handshake gate and the HTTP routes test with `path in ...`."""

    def __init__(self, stream_paths: Collection[str]):
        self.stream_paths = stream_paths

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str) and (path in self.stream_paths or call_id_of(path) is not None)

    def __iter__(self) -> Iterator[str]:
        yield from self.stream_paths
        yield CALL_EVENTS_PATH

    def __len__(self) -> int:
        return len(self.stream_paths) + 1


class CallSubscriber:
    """One subscriber connection. `run()` serves it to its end; `request_stop()` is the server's SIGTERM."""

    def __init__(self, websocket: ServerConnection, calls: CallRegistry, call_id: str, *, drain_timeout_s: float):
        self.websocket = websocket
        self.calls = calls
        self.call_id = call_id
        self.drain_timeout_s = drain_timeout_s
        self._sending: asyncio.Task | None = None
        self._stop_timer: asyncio.TimerHandle | None = None
        self.stopping = False

    async def run(self) -> None:
        try:
            subscription = self.calls.subscribe(self.call_id)
        except CallsFull as error:
            log.info("subscriber of call %s refused: %s", self.call_id, error)
            await self.websocket.close(errors.TRY_AGAIN_LATER, "too many calls: try again later")
            return
        log.info("subscriber of call %s connected", self.call_id)
        loop = asyncio.get_running_loop()
        self._sending = loop.create_task(self._send_all(subscription))
        listening = loop.create_task(self._discard_incoming())
        try:
            if self.stopping:
                self._stop_soon()
            await asyncio.wait({self._sending, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (self._sending, listening):
                task.cancel()
            await asyncio.wait({self._sending, listening})
            subscription.close()
            if self._stop_timer is not None:
                self._stop_timer.cancel()
        gone = listening.done() and not listening.cancelled()  # the subscriber closed or vanished first
        if gone or (not self._sending.cancelled() and self._sending.exception() is not None):
            log.info("subscriber of call %s left", self.call_id)
            return
        if subscription.overflowed:
            code, reason = errors.POLICY_VIOLATION, "subscriber too slow: messages were dropped"
        elif self._sending.cancelled():
            code, reason = errors.GOING_AWAY, "server is shutting down"
        else:
            code, reason = errors.NORMAL, "call ended"
        with contextlib.suppress(ConnectionClosed):
            await self.websocket.close(code, reason)

    def request_stop(self) -> None:
        """The server stops: a call still streaming gets `drain_timeout_s` to deliver its last finals and end."""
        if self.stopping:
            return
        self.stopping = True
        if self._sending is not None:
            self._stop_soon()

    def _stop_soon(self) -> None:
        call = self.calls.get(self.call_id)
        live = call is not None and call.started and not call.ended
        delay = self.drain_timeout_s if live else 0.0
        self._stop_timer = asyncio.get_running_loop().call_later(delay, self._sending.cancel)

    async def _send_all(self, subscription) -> None:
        async for message in subscription:
            await self.websocket.send(json.dumps(message, ensure_ascii=False, separators=(",", ":")))

    async def _discard_incoming(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for _ in self.websocket:
                pass
