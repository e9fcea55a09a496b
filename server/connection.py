"""One WebSocket connection of the native protocol: frames in -> Session calls; Session events -> frames out.

The thin asyncio layer between `NativeProtocol` (parsing) and `Session` (the stream): two tasks, a receiver that
feeds the session and a sender that sends its events in order, plus the timeouts and the teardown. Every way a
connection can end goes through `_finish`, which asks `errors.decide_close` for the close code.

    awaiting start --start--> streaming --end--> draining (finals, summary) --> close 1000
                  (server full, not ready: 1013; bad input: error event [+ finals] + 1003/1007/1009;
                   idle: 1008; SIGTERM: finals + 1001; internal: 1011; client gone: abort, nothing sent)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from typing import Callable

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from qasr.model.audio import SAMPLE_RATE
from qasr.server import errors, logs
from qasr.server.limits import ServerLimits, StreamDefaults
from qasr.server.metrics import ServerMetrics
from qasr.server.protocol import Audio, End, Flush, NativeProtocol, Notice, Start, StreamConfig
from qasr.streaming import events
from qasr.streaming.session import Session, SessionOptions

log = logging.getLogger("qasr.server")


class StreamConnection:
    def __init__(self, websocket: ServerConnection, *, engine, limits: ServerLimits, defaults: StreamDefaults,
                 metrics: ServerMetrics):
        self.websocket = websocket
        self.engine = engine
        self.limits = limits
        self.metrics = metrics
        self.protocol = NativeProtocol(limits=limits, defaults=defaults)
        self.session_id = uuid.uuid4().hex[:16]
        logs.bind_session(self.session_id)  # what this connection's task logs carries its session id
        self.session: Session | None = None
        self.stopping = False  # the server is shutting down
        self._receiver: asyncio.Task | None = None  # the task reading from the socket, interrupted by stop
        self._sender: asyncio.Task | None = None  # the task sending the session's events
        self._stop_timer: asyncio.TimerHandle | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def run(self, *, admit: Callable[[], None]) -> None:
        """Serve the connection to its end. `admit()` raises ServerFull/NotReady to turn the client away."""
        try:
            admit()
            config, notices = await self._receive(self._receive_start())
            await self._open_session(config, notices)
            await self._stream()
            close_code = errors.GOING_AWAY if self.stopping else errors.NORMAL
            await self._close(close_code, "server is shutting down" if self.stopping else "")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # one place decides how the connection ends
            await self._finish(exc)
        finally:
            if self._stop_timer is not None:
                self._stop_timer.cancel()
            await self._teardown()

    def request_stop(self) -> None:
        """SIGTERM: stop reading, finalise what is open, close with 1001, within the drain timeout."""
        if self.stopping:
            return
        self.stopping = True
        if self._receiver is not None:
            self._receiver.cancel()
        self._stop_timer = asyncio.get_running_loop().call_later(self.limits.drain_timeout_s, self._give_up)

    def _give_up(self) -> None:
        """The drain timeout ran out: stop waiting for finals."""
        if self._sender is not None:
            self._sender.cancel()

    async def _teardown(self) -> None:
        """Whatever happened: cancel engine work, release streams, drop buffers; no task outlives the connection."""
        for task in (self._receiver, self._sender):
            if task is not None and not task.done():
                task.cancel()
        pending = [task for task in (self._receiver, self._sender) if task is not None]
        if pending:
            await asyncio.wait(pending)
        if self.session is not None:
            await self.session.abort()
            self.metrics.sessions_active -= 1

    # -- receiving -------------------------------------------------------------------------------------------

    async def _receive(self, coroutine):
        """Run one receiving step as a task that stop() may interrupt (then raise ShuttingDown)."""
        if self.stopping:
            coroutine.close()
            raise errors.ShuttingDown("server is shutting down")
        task = asyncio.get_running_loop().create_task(coroutine)
        self._receiver = task  # kept after it is done: _teardown waits for it
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.cancelled():  # only request_stop() cancels it
            raise errors.ShuttingDown("server is shutting down")
        return task.result()

    async def _receive_start(self) -> tuple[StreamConfig, list[Notice]]:
        # anything but a start raises MalformedMessage; a connection that sends nothing gives its slot back soon
        with _IdleWatch(min(self.limits.start_timeout_s, self.limits.idle_timeout_s)):
            commands = self.protocol.receive(await self.websocket.recv())
        start, *notices = commands
        assert isinstance(start, Start)  # the protocol guarantees it in AWAITING_START
        return start.config, notices

    async def _receive_stream(self) -> None:
        """Feed the session until `end`; pauses reading while too many finals are pending."""
        session = self.session
        with _IdleWatch(self.limits.idle_timeout_s) as idle:
            while True:
                await session.wait_for_capacity()
                idle.heard()  # the server's own pause does not count as the client's silence
                message = await self.websocket.recv()
                idle.heard()
                for command in self.protocol.receive(message):
                    if isinstance(command, Audio):
                        session.feed(command.samples)
                        self.metrics.audio_seconds_total.inc(len(command.samples) / self.protocol.config.sample_rate)
                    elif isinstance(command, Flush):
                        session.flush()
                    elif isinstance(command, End):
                        return
                    elif isinstance(command, Notice):
                        session.notify(events.Error(command.code, command.message))

    # -- the stream ------------------------------------------------------------------------------------------

    async def _open_session(self, config: StreamConfig, notices: list[Notice]) -> None:
        try:  # a context that leaves no room for the longest segment would fail or cut every final later
            await self.engine.check_context(config.context, language=config.language,
                                            max_audio_seconds=config.vad.max_segment_s)
        except ValueError as error:
            raise errors.MalformedMessage(str(error)) from None
        options = SessionOptions(input_rate=config.sample_rate, language=config.language, context=config.context,
                                 partials=config.partials, partial_interval_ms=config.partial_interval_ms,
                                 vad=config.vad.to_options(), max_pending_finals=self.limits.max_pending_finals)
        self.session = Session(self.engine, self.session_id, options, observer=self.metrics)
        self.metrics.sessions_active += 1
        self.metrics.sessions_total.inc()
        await self._send(events.Ready(self.session_id, self.engine.model_name, config.sample_rate, SAMPLE_RATE,
                                      self.limits.to_client(), dataclasses.asdict(config)))
        for notice in notices:
            self.session.notify(events.Error(notice.code, notice.message))
        log.info("session %s started: %d Hz %s x%d, language %s", self.session_id, config.sample_rate,
                 config.encoding, config.channels, config.language or "auto")

    async def _stream(self) -> None:
        """Receive until `end` while sending events; then send the rest (finals, summary)."""
        self._sender = asyncio.get_running_loop().create_task(self._send_events())
        receiving = asyncio.ensure_future(self._receive(self._receive_stream()))
        try:
            await asyncio.wait({receiving, self._sender}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not receiving.done():  # the sender stopped first (the engine failed, the client is gone) or we
                receiving.cancel()  # are being cancelled: stop reading either way
                await asyncio.wait({receiving})
        if receiving.cancelled():  # by the finally above: the sender stopped first
            self._sender.result()  # raises why the events stopped
            raise errors.ServerError("the event stream ended before the client's stream did")
        receiving.result()  # raises the client's mistake, a disconnect, idle, or stop; returns on `end`
        self.session.end()
        await self._drain()

    async def _send_events(self) -> None:
        while (event := await self.session.next_event()) is not None:
            await self._send(event)

    async def _drain(self, timeout: float | None = None) -> None:
        """Until the last event is sent; stop's timer (or `timeout`) cuts it short. Raises the sender's failure."""
        done, _ = await asyncio.wait({self._sender}, timeout=timeout)
        if not done:
            self._sender.cancel()
            await asyncio.wait({self._sender})
        if not self._sender.cancelled():
            self._sender.result()

    async def _send(self, event: events.ServerEvent) -> None:
        await self.websocket.send(self.protocol.encode(event))
        if isinstance(event, events.Error):
            self.metrics.error_sent(event.code)

    # -- the end ---------------------------------------------------------------------------------------------

    async def _finish(self, exc: BaseException) -> None:
        decision = errors.decide_close(exc, stopping=self.stopping)
        if decision is None:  # the client went away (or the library closed with 1009): nothing more to send
            self._record_disconnect(exc)
            return
        fatal = events.Error(decision.error_code, decision.message, fatal=True)
        if decision.finalise and self.session is not None and self._sender is not None and not self._sender.done():
            self.session.notify(fatal)
            self.session.end()
            try:
                await self._drain(timeout=self.limits.drain_timeout_s)
            except Exception:  # the close below still happens; the reason is logged
                log.info("session %s: finals not delivered before closing", self.session_id, exc_info=True)
        else:
            if self._sender is not None:
                self._sender.cancel()
                await asyncio.wait({self._sender})
            try:
                await self._send(fatal)
            except ConnectionClosed:
                pass
        await self._close(decision.close_code, decision.error_code)

    async def _close(self, code: int, reason: str) -> None:
        # Frames the client sent after we stopped reading fill websockets' queue, which then stops reading the
        # socket, and the client's close frame would wait behind them for close_timeout: discard them meanwhile.
        discarding = asyncio.get_running_loop().create_task(self._discard_incoming())
        try:
            await self.websocket.close(code, reason)
        finally:
            discarding.cancel()
            await asyncio.wait({discarding})
        self.metrics.connection_closed(code)
        log.info("session %s closed with %d %s", self.session_id, code, reason)

    async def _discard_incoming(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                await self.websocket.recv()

    def _record_disconnect(self, exc: BaseException) -> None:
        sent = getattr(exc, "sent", None)
        if sent is not None and sent.code == errors.MESSAGE_TOO_BIG:
            self.metrics.error_sent(errors.MessageTooBig.error_code)
            self.metrics.connection_closed(errors.MESSAGE_TOO_BIG)
        else:
            received = getattr(exc, "rcvd", None)
            self.metrics.connection_closed(received.code if received is not None else None)
        log.info("session %s: client disconnected (%s)", self.session_id, exc)


class _IdleWatch:
    """The idle timeout for the receiving task: `with _IdleWatch(s) as idle:` cancels the task after `s` seconds
    without `idle.heard()` and raises IdleTimeout from the block. One timer, re-armed lazily: a message costs a clock
    read, not the timer that `wait_for` builds and cancels per message (~13% of the event loop at 600 streams on
    the H200)."""

    def __init__(self, timeout_s: float):
        self._loop = asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self._task = asyncio.current_task()  # cancelled when the timeout passes
        self.expired = False
        self.heard()
        self._timer = self._loop.call_later(timeout_s, self._check)

    def heard(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        quiet = self._loop.time() - self._last
        if quiet < self.timeout_s:
            self._timer = self._loop.call_later(self.timeout_s - quiet, self._check)
            return
        self.expired = True
        self._task.cancel()

    def __enter__(self) -> "_IdleWatch":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self._timer.cancel()
        if exc_type is asyncio.CancelledError and self.expired:
            raise errors.IdleTimeout(f"no message for {self.timeout_s:g} s") from None
