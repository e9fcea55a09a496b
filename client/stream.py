"""Streaming audio to a qasr server and reading its events, with asyncio.

Two levels:

`stream_audio(url, source, ...)` pumps an audio source (an async iterable of numpy chunks: `file_source`,
`microphone_source`, or your own) into one stream and yields its events; `stop()` ends it cleanly::

    stream = stream_audio("ws://127.0.0.1:8765/v1/stream", file_source("talk.wav"), language="English")
    async for event in stream:            # Ready, SpeechStarted, Partial..., Final, ..., Summary
        if isinstance(event, Final):
            print(f"[{event.start:.2f}-{event.end:.2f}] {event.text}")
    # stream.stop() (e.g. from a signal handler): send `end`, still receive every final and the summary

`StreamClient` is one connection driven by hand (connect, send_audio, flush, end, events), for code that already
has its own audio loop.

Authentication (a server with API keys, docs/security.md): `api_key=KEY` is sent as `Authorization: Bearer KEY`,
`token=TOKEN` (from POST /v1/tokens) as the `qasr.token.TOKEN` subprotocol. A handshake the server refuses raises
`AuthenticationFailed` (401), `AccessDenied` (403), `TooManyConnections` (429) or `ServiceUnavailable` (503: loading
or shutting down), never retried on 401 or 403.

Ending: after the source runs out (or `stop()`), the client sends `end`, receives the remaining finals and the
summary, and the server closes with 1000; the iteration then simply finishes. Any other ending raises a
`StreamClosed` (`ConnectionLost` when the connection just dropped) after every event that did arrive was yielded.
With `reconnect=N`, a stream the server dropped mid-way (restart, 1001/1006/1013) is reopened up to N times in a
row, with the same credential; the source carries on, and times and segment ids continue from where the last
connection stopped. A server that shuts down (1001) finalises what it read and says in its `summary` how much that
was; audio sent but never read (in a socket or a proxy when the server stopped reading) is sent again first on the
next connection (at most the last `replay_s` seconds; `Reconnecting.resend_s` says how much), so a drain loses no
audio, even after `end` was sent. A connection lost without a summary (1006) loses its open segment.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import socket
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator, ClassVar, Mapping, Union

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from qasr.client.errors import (NORMAL_CLOSURE, AccessDenied, AuthenticationFailed, ClientError, ConnectionLost,
                                HandshakeRefused, ServerUnreachable, ServiceUnavailable, StreamClosed,
                                TooManyConnections)
from qasr.client.protocol import (END, FLUSH, Credentials, StreamOptions, bytes_per_frame, encode_audio,
                                  parse_event, start_message)
from qasr.client.replay import SentAudio
from qasr.streaming.events import Error, Final, Partial, Ready, ServerEvent, SpeechStarted, Summary, Word


@dataclass(frozen=True)
class Reconnecting:
    """Client-side event: the connection ended early and a new stream is about to be opened."""

    TYPE: ClassVar[str] = "reconnecting"
    attempt: int  # 1..max_attempts, counted since the last successful connection
    max_attempts: int
    delay_s: float  # wait before this attempt
    reason: str  # why the previous connection ended
    resend_s: float = 0.0  # audio the previous connection's server never read (its summary says what it read): sent
    # again first on the next connection, at its true place on the timeline
    lost_s: float = 0.0  # unread audio older than the replay window (AudioStream's replay_s): it cannot be sent again


@dataclass(frozen=True)
class AudioDropped:
    """Client-side event: the source fell too far behind and dropped its oldest audio, which was never sent
    (`MicrophoneSource` past its `max_buffer_s`). Yielded after the next server event once the total grows; any
    source with a `dropped_s` attribute reports this way."""

    TYPE: ClassVar[str] = "audio_dropped"
    dropped_s: float  # in all since the stream began


StreamEvent = Union[ServerEvent, Reconnecting, AudioDropped]


class StreamClient:
    """One stream over one WebSocket connection.

        async with StreamClient(url, StreamOptions(sample_rate=16000)) as client:   # connects, sends start
            ... await client.send_audio(chunk) ...; await client.end()
            async for event in client.events(): ...                                   # until the server closes

    api_key: for a server that requires one (sent as `Authorization: Bearer`); token: a token from the server's
    POST /v1/tokens instead (sent as the `qasr.token.` subprotocol). At most one of them.
    """

    def __init__(self, url: str, options: StreamOptions = StreamOptions(), *, api_key: str | None = None,
                 token: str | None = None, open_timeout_s: float = 10.0, close_timeout_s: float = 10.0):
        if not url.startswith(("ws://", "wss://")):
            raise ValueError(f"the server URL must start with ws:// or wss://, got {url!r} "
                             "(e.g. ws://127.0.0.1:8765/v1/stream)")
        self.url = url
        self.options = options
        self.credentials = Credentials(api_key, token)
        self.open_timeout_s = open_timeout_s
        self.close_timeout_s = close_timeout_s
        self.ready: Ready | None = None  # once connected
        self.summary: Summary | None = None  # once received
        self.samples_sent = 0  # per channel
        self.ended = False  # `end` was sent
        self._websocket: ClientConnection | None = None
        self._fatal_error: Error | None = None  # the error event the server sent before closing
        self._closed_by_us = False

    async def __aenter__(self) -> "StreamClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def connect(self) -> Ready:
        """Open the connection, send `start`, wait for `ready`. Raises ServerUnreachable, HandshakeRefused (401
        AuthenticationFailed, 403, 429) when the handshake is refused, or StreamClosed when the server turns the
        stream away (full, loading, an option it cannot take)."""
        try:
            self._websocket = await connect(self.url, open_timeout=self.open_timeout_s, max_size=None,
                                            close_timeout=self.close_timeout_s,
                                            additional_headers=self.credentials.headers() or None,
                                            subprotocols=self.credentials.subprotocols() or None)
        except InvalidURI as error:
            raise ValueError(f"not a valid WebSocket URL: {self.url!r} ({error})") from None
        except InvalidStatus as error:
            refused = self._refused(error.response.status_code, error.response.body)
            if refused is not None:
                raise refused from None
            status = error.response.status_code
            raise ServerUnreachable(f"{self.url} answered HTTP {status} instead of a WebSocket: is this a qasr "
                                    "server's stream path (/v1/stream)?") from None
        except (OSError, asyncio.TimeoutError, TimeoutError, InvalidHandshake) as error:
            raise ServerUnreachable(f"cannot reach a qasr server at {self.url}: {_why_unreachable(error, self)}; "
                                    "is qasr-server running there?") from None
        try:
            with contextlib.suppress(ConnectionClosed):  # turned away at once (full, loading): the reason is
                await self._websocket.send(start_message(self.options))  # in the frames received, read below
            await asyncio.wait_for(self._receive_ready(), self.open_timeout_s)
        except ConnectionClosed as closed:
            raise self._close_error(closed) or StreamClosed(NORMAL_CLOSURE, "closed before ready") from None
        except asyncio.TimeoutError:
            await self._websocket.close()
            raise ServerUnreachable(f"{self.url} accepted the connection but sent no `ready` within "
                                    f"{self.open_timeout_s:g} s") from None
        except BaseException:
            await self._websocket.close()
            raise
        return self.ready

    async def _receive_ready(self) -> None:
        while self.ready is None:
            event = parse_event(await self._websocket.recv())
            if isinstance(event, Error) and event.fatal:
                self._fatal_error = event  # server_full, not_ready, unsupported: the close follows
            elif isinstance(event, Ready):
                self.ready = event

    async def send_audio(self, chunk: np.ndarray) -> None:
        """Send one chunk ([n] or [n, channels], float in [-1, 1] or int16). Raises StreamClosed once closed."""
        frame = encode_audio(chunk, self.options)
        await self._send(frame)
        self.samples_sent += len(frame) // bytes_per_frame(self.options)

    async def flush(self) -> None:
        """Close the open segment now (push-to-talk release); its final follows, the stream goes on."""
        await self._send(FLUSH)

    async def end(self) -> None:
        """No more audio: the remaining finals, then the summary, then the server closes with 1000."""
        if not self.ended:
            self.ended = True
            await self._send(END)

    async def events(self) -> AsyncIterator[ServerEvent]:
        """Events until the server closes. Returns after a normal end (1000, or any close once `end` was answered
        with the summary); raises StreamClosed/ConnectionLost otherwise, after yielding every event received."""
        websocket = self._connected()
        try:
            while True:
                event = parse_event(await websocket.recv())
                if event is None:
                    continue
                if isinstance(event, Error) and event.fatal:
                    self._fatal_error = event
                elif isinstance(event, Summary):
                    self.summary = event
                yield event
        except ConnectionClosed as closed:
            error = self._close_error(closed)
            if error is not None:
                raise error from None

    @property
    def close_code(self) -> int | None:
        """The WebSocket close code once the connection has closed (1000 after a normal end), else None."""
        return self._websocket.close_code if self._websocket is not None else None

    @property
    def complete(self) -> bool:
        """The client ended the stream and the server's summary covers every frame sent: nothing more can arrive.
        (A server that shut down after `end` went out but before it read everything answers with a shorter one.)"""
        return self.ended and self.summary is not None and self.unheard_samples <= 0

    @property
    def unheard_samples(self) -> int | None:
        """Frames sent on this connection that the server never read, by its summary's `audio_seconds` (a shutdown's
        summary counts what was read before reading stopped); None before a summary. Negative when the server read a
        frame whose send was cut short (not counted in samples_sent)."""
        if self.summary is None:
            return None
        return self.samples_sent - round(self.summary.audio_seconds * self.options.sample_rate)

    async def close(self) -> None:
        """Close the connection (1000). Without `end` first, the server drops what it has not finalised."""
        if self._websocket is not None:
            self._closed_by_us = True
            await self._websocket.close()

    # -- internals -------------------------------------------------------------------------------------------

    def _refused(self, status: int, body: bytes | None) -> HandshakeRefused | None:
        """The error for a handshake refused with 401, 403, 429 or 503, saying what to do; None for other
        statuses."""
        message = self.credentials.redact(_first_line(body))
        answered = f"{self.url} answered HTTP {status}" + (f" ({message})" if message else "")
        if status == 401:
            what_to_do = {
                None: "the server requires an API key: pass api_key=KEY, or token= with a token from its "
                      "POST /v1/tokens",
                "api_key": "the server does not accept this API key: check it (retrying will not help)",
                "token": "the server does not accept this token (an expired or foreign one): mint a new one with "
                         "POST /v1/tokens, or pass api_key=",
            }[self.credentials.kind]
            return AuthenticationFailed(f"{answered}: {what_to_do}", status, message, self.credentials.kind)
        if status == 403:
            return AccessDenied(f"{answered}: connections from here are not allowed; ask the server's operator",
                                status, message)
        if status == 429:
            return TooManyConnections(f"{answered}: too many connections from this address are open; close some "
                                      "or try again later", status, message)
        if status == 503:
            return ServiceUnavailable(f"{answered}: the server is loading its model or shutting down; try again "
                                      "shortly (reconnect=N does)", status, message)
        return None

    def _connected(self) -> ClientConnection:
        if self._websocket is None:
            raise RuntimeError("StreamClient is not connected: call connect() (or use `async with`) first")
        return self._websocket

    async def _send(self, message: str | bytes) -> None:
        try:
            await self._connected().send(message)
        except ConnectionClosed as closed:
            raise self._close_error(closed) or StreamClosed(NORMAL_CLOSURE, "the stream has ended") from None

    def _close_error(self, closed: ConnectionClosed) -> StreamClosed | None:
        """The exception for how the connection closed; None for a normal end."""
        if closed.rcvd is None:
            return None if self._closed_by_us else ConnectionLost("no close frame from the server")
        if closed.rcvd.code == NORMAL_CLOSURE or self.complete:
            return None
        return StreamClosed(closed.rcvd.code, closed.rcvd.reason, self._fatal_error)


class AudioStream:
    """An audio source streamed to the server; iterate it for the events. See the module docstring."""

    def __init__(self, url: str, source: AsyncIterable[np.ndarray], options: StreamOptions, *, reconnect: int = 0,
                 reconnect_delay_s: float = 1.0, open_timeout_s: float = 10.0, api_key: str | None = None,
                 token: str | None = None, replay_s: float = 30.0):
        if reconnect < 0:
            raise ValueError(f"reconnect must be >= 0 (attempts in a row), got {reconnect}")
        if not replay_s >= 0:
            raise ValueError(f"replay_s must be >= 0 seconds, got {replay_s}")
        self.url = url
        self.source = source
        self.options = options
        self.credentials = Credentials(api_key, token)  # checked now; every connection, reconnects too, sends it
        self.reconnect = reconnect
        self.reconnect_delay_s = reconnect_delay_s
        self.open_timeout_s = open_timeout_s
        self.client: StreamClient | None = None  # the current connection
        self._stopping = asyncio.Event()
        self._chunks: AsyncIterator[np.ndarray] | None = None
        self._next_chunk_task: asyncio.Task | None = None  # survives a reconnect: no chunk is pulled twice
        # sent before the source's next chunk: what a server never read, then a chunk whose send failed
        self._pending: collections.deque[np.ndarray] = collections.deque()
        # the current connection's audio, for a reconnect (kept only when there can be one)
        self._sent = SentAudio(round(replay_s * options.sample_rate) if reconnect else 0)
        self._source_error: BaseException | None = None
        self._source_done = False  # the source ran out (or failed): `end` goes out after the last chunk
        self._iterating = False
        self._dropped_reported_s = 0.0
        self._capture_stopped = False  # stop() asked a live source to stop recording; draining what it holds

    def stop(self) -> None:
        """End the stream: stop reading the source, send `end`; the remaining finals and the summary still
        arrive. Safe to call from a signal handler on the event loop, and more than once."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        if self._iterating:
            raise RuntimeError("an AudioStream can be iterated once")
        self._iterating = True
        return self._run()

    async def _run(self) -> AsyncIterator[StreamEvent]:
        self._chunks = aiter(self.source)
        timeline = _Timeline()
        attempts = 0
        try:
            while True:
                self.client = StreamClient(self.url, self.options, api_key=self.credentials.api_key,
                                           token=self.credentials.token, open_timeout_s=self.open_timeout_s)
                pump = None
                try:
                    yield await self.client.connect()
                    attempts = 0
                    pump = asyncio.ensure_future(self._pump(self.client))
                    async for event in self.client.events():
                        yield timeline.shift(event)
                        if (dropped := self._newly_dropped()) is not None:
                            yield dropped
                    if self._source_error is not None:
                        raise self._source_error
                    return
                except (ServerUnreachable, StreamClosed, HandshakeRefused) as error:
                    await _cancelled(pump)  # before the unread audio goes in front of a chunk it failed to send
                    pump = None
                    covered, resend, lost = self._carry_over_unread(self.client)
                    if not self._may_retry(error, attempts):
                        raise
                    attempts += 1
                    timeline.advance(self.client, covered)
                    delay = self.reconnect_delay_s * attempts
                    rate = self.options.sample_rate
                    yield Reconnecting(attempts, self.reconnect, delay, str(error), resend / rate, lost / rate)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), delay)
                    if self.stopping and not self._pending:  # stopped while disconnected, nothing left to send
                        raise error
                finally:
                    await _cancelled(pump)
                    await self.client.close()
        finally:
            await self._close_source()

    def _may_retry(self, error: ClientError, attempts: int) -> bool:
        """Retryable, attempts left, and audio still to send: the source's, or what no server has read yet."""
        finished = self.stopping or self._source_done or (self.client is not None and self.client.ended)
        return error.retryable and attempts < self.reconnect and (bool(self._pending) or not finished)

    def _carry_over_unread(self, client: StreamClient) -> tuple[int, int, int]:
        """After a connection ended early: put the audio its server never read (by its summary) in front of what
        the next connection sends. -> (frames of this connection now behind the timeline, frames to send again,
        frames unread but older than the replay window). Without a summary everything sent counts as covered."""
        sent, unread = client.samples_sent, client.unheard_samples
        held = self._sent
        self._sent = SentAudio(held.window_samples)
        if client.ready is None or not unread:
            return sent, 0, 0
        if unread < 0:  # the server read (part of) the chunk whose send was cut short: that part is not sent again
            self._drop_pending(-unread)
            return sent - unread, 0, 0
        resend = held.tail(unread)
        num_resend = sum(len(chunk) for chunk in resend)
        self._pending.extendleft(reversed(resend))
        return sent - num_resend, num_resend, unread - num_resend

    def _drop_pending(self, num_samples: int) -> None:
        while num_samples > 0 and self._pending:
            chunk = self._pending.popleft()
            if len(chunk) > num_samples:
                self._pending.appendleft(chunk[num_samples:])
            num_samples -= len(chunk)

    def _newly_dropped(self) -> AudioDropped | None:
        dropped_s = getattr(self.source, "dropped_s", 0.0)
        if dropped_s <= self._dropped_reported_s:
            return None
        self._dropped_reported_s = dropped_s
        return AudioDropped(dropped_s)

    async def _pump(self, client: StreamClient) -> None:
        """Source -> socket until the source ends or stop(); then `end`. A failing source ends the stream
        cleanly too (its error is raised after the last final)."""
        try:
            while (chunk := await self._next_chunk()) is not None:
                try:
                    await client.send_audio(chunk)
                except StreamClosed:  # the receiving side reports how; keep the chunk for a reconnect
                    self._pending.appendleft(chunk)
                    return
                except asyncio.CancelledError:  # a reconnect cut a send stuck on backpressure: counted as unsent
                    self._pending.appendleft(chunk)  # (a summary that says the server read it drops it again)
                    raise
                self._sent.add(chunk)
        except Exception as error:  # the source (or a chunk it produced) failed
            self._source_error = error
            self._source_done = True
        with contextlib.suppress(StreamClosed):
            await client.end()

    async def _next_chunk(self) -> np.ndarray | None:
        """The next chunk from the source; None once it ends or stop() was called. A live source that can stop
        capturing (`stop_capture`, the microphone) is drained on stop(): what it already recorded is still sent."""
        if self._pending:
            return self._pending.popleft()
        if self._source_done:
            return None
        stop_capture = getattr(self.source, "stop_capture", None)
        if self.stopping and stop_capture is None:
            return None
        if self.stopping and not self._capture_stopped:
            self._capture_stopped = True
            await stop_capture()
        if self._next_chunk_task is None:
            self._next_chunk_task = asyncio.ensure_future(anext(self._chunks))
        if self._capture_stopped:  # draining: the source ends by itself
            await asyncio.wait({self._next_chunk_task})
        else:
            stop_wait = asyncio.ensure_future(self._stopping.wait())
            try:
                await asyncio.wait({self._next_chunk_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_wait.cancel()
            if not self._next_chunk_task.done():  # stopped while waiting
                return None if stop_capture is None else await self._next_chunk()
        task, self._next_chunk_task = self._next_chunk_task, None
        try:
            return task.result()
        except StopAsyncIteration:
            self._source_done = True
            return None

    async def _close_source(self) -> None:
        if self._next_chunk_task is not None and not self._next_chunk_task.done():
            self._next_chunk_task.cancel()
            await asyncio.wait({self._next_chunk_task})
        close = getattr(self._chunks, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()


def stream_audio(url: str, source: AsyncIterable[np.ndarray], *, language: str | None = None, context: str = "",
                 sample_rate: int | None = None, encoding: str = "s16le", channels: int | None = None,
                 format: str = "json", partials: bool = True, partial_interval_ms: int | None = None,
                 vad: Mapping[str, float] | None = None, words: bool = False, reconnect: int = 0,
                 reconnect_delay_s: float = 1.0, open_timeout_s: float = 10.0, api_key: str | None = None,
                 token: str | None = None, replay_s: float = 30.0) -> AudioStream:
    """Stream `source` to the server at `url`; iterate the result for events (see the module docstring).

    sample_rate/channels: of the source's chunks; None takes the source's own `sample_rate`/`channels`
    attributes (file_source and microphone_source have them), else 16000 Hz mono. reconnect: how many times in a
    row to reopen a stream the server dropped (0: raise at once). replay_s: with reconnect, the last seconds sent on
    a connection are kept, so that what a shutting-down server never read is sent again. api_key / token: for a
    server that requires one (see StreamClient). words: every Final carries `words` (Word: word, start, end in
    stream seconds) or a `words_reason`; a server without an aligner refuses the stream (StreamClosed 1003). The
    other options are the `start` message's.
    """
    options = StreamOptions(sample_rate=sample_rate or getattr(source, "sample_rate", 16000),
                            channels=channels or getattr(source, "channels", 1), encoding=encoding,
                            language=language, context=context, format=format, partials=partials,
                            partial_interval_ms=partial_interval_ms, vad=vad, words=words)
    return AudioStream(url, source, options, reconnect=reconnect, reconnect_delay_s=reconnect_delay_s,
                       open_timeout_s=open_timeout_s, api_key=api_key, token=token, replay_s=replay_s)


class _Timeline:
    """Keeps times, segment ids and the summary continuous across reconnections: each new server stream starts
    at 0, so its events are shifted by what the earlier connections covered."""

    def __init__(self):
        self.offset_s = 0.0  # audio sent on earlier connections
        self.segment_offset = 0  # segments those connections opened
        self.speech_s = 0.0  # speech finalised on them
        self._next_segment = 0  # on the current connection
        self._speech_now = 0.0

    def advance(self, client: StreamClient, covered_samples: int) -> None:
        """A connection ended early: the next one continues `covered_samples` (frames) after its start (what its
        server read; the rest of what was sent goes again)."""
        if client.ready is not None:
            self.offset_s += covered_samples / client.options.sample_rate
        self.segment_offset += self._next_segment
        self.speech_s += self._speech_now
        self._next_segment, self._speech_now = 0, 0.0

    def shift(self, event: ServerEvent) -> ServerEvent:
        if isinstance(event, (SpeechStarted, Partial, Final)):
            self._next_segment = max(self._next_segment, event.segment_id + 1)
            if isinstance(event, Final):
                self._speech_now += event.end - event.start
        if not (self.offset_s or self.segment_offset):
            return event
        if isinstance(event, SpeechStarted):
            return dataclasses.replace(event, segment_id=event.segment_id + self.segment_offset,
                                       start=event.start + self.offset_s)
        if isinstance(event, Final) and event.words:
            event = dataclasses.replace(event, words=tuple(Word(word.word, word.start + self.offset_s,
                                                                word.end + self.offset_s) for word in event.words))
        if isinstance(event, (Partial, Final)):
            return dataclasses.replace(event, segment_id=event.segment_id + self.segment_offset,
                                       start=event.start + self.offset_s, end=event.end + self.offset_s)
        if isinstance(event, Summary):
            return Summary(segments=event.segments + self.segment_offset,
                           audio_seconds=event.audio_seconds + self.offset_s,
                           speech_seconds=event.speech_seconds + self.speech_s)
        return event


async def _cancelled(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.wait({task})


def _first_line(body: bytes | None, limit: int = 300) -> str:
    """The first line of an HTTP error body: the server's reason, short."""
    lines = (body or b"").decode("utf-8", "replace").strip().splitlines()
    return lines[0][:limit] if lines else ""


def _why_unreachable(error: BaseException, client: StreamClient) -> str:
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, socket.gaierror):
        return "unknown host"
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return f"no answer within {client.open_timeout_s:g} s"
    return str(error) or type(error).__name__
