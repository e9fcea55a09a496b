"""The qasr server: one WebSocket port for streams (`/v1/stream`; OpenAI Realtime `/v1/realtime`, Deepgram
`/v1/listen` and the telephony paths: WIRE_ADAPTERS), health, readiness, metrics and the web page.

    server = QasrServer(engine, ServerConfig(port=0))
    await server.start()          # listening; server.port is the bound port
    ...
    await server.stop()           # SIGTERM path: refuse new streams (503), finalise open ones, close 1001, close
                                  # the engine, then the port (/healthz and /readyz answer until then)

The server owns the engine it is given (or loads with `load_engine`): `stop()` closes it after the last stream.
Each connection is a `StreamConnection`; one failing never reaches another or the server.
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
import os
import typing
import weakref

import numpy as np
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response

from qasr.engine.face import SpeechEngine
from qasr.engine.request import DecodeRequest
from qasr.server import errors
from qasr.server.admission import Admission, AdmissionSettings
from qasr.server.call_events import CallSubscriber, WebSocketPaths, call_id_of
from qasr.server.calls import CallOptions, CallRegistry
from qasr.server.connection import StreamConnection, WireAdapter
from qasr.server.deepgram import DeepgramAdapter
from qasr.server.engine_load import EngineLoad
from qasr.server.gate import HandshakeGate
from qasr.server.http import STREAM_PATH, HttpRoutes
from qasr.server.limits import ServerLimits
from qasr.server.metrics import ServerMetrics
from qasr.server.openai_realtime import OpenAIRealtimeAdapter
from qasr.server.protocol import NativeProtocol
from qasr.server.quotas import GuardedAdapter, KeyUsage
from qasr.server.security import SecuritySettings
from qasr.server.telephony import TELEPHONY_ADAPTERS
from qasr.server.webhooks import WebhookOptions, WebhookSender
from qasr.streaming.settings import StreamLimits, StreamSettings

if typing.TYPE_CHECKING:
    from qasr.server.workers import ReplicaView

log = logging.getLogger("qasr.server")

WARM_UP_STREAM = f"qasr-warm-up-{os.getpid()}"  # the stream id of the decode served before /readyz says ready (one
# per process: several front-end workers warm up on one engine at once)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765  # 0: any free port (see QasrServer.port)
    limits: ServerLimits = field(default_factory=ServerLimits)  # per connection, whatever the stream
    stream_limits: StreamLimits = field(default_factory=StreamLimits)  # what a stream's settings may ask for
    defaults: StreamSettings = field(default_factory=StreamSettings)  # a stream's settings where it asks nothing
    web_root: Path | None = None  # the static page's folder (http.find_web_root), None: no page
    ping_interval_s: float | None = 20.0  # keepalive pings find clients that vanished without closing
    security: SecuritySettings = field(default_factory=SecuritySettings)  # auth, TLS, origins, client limits
    calls: CallOptions = field(default_factory=CallOptions)  # telephony calls out: replay, webhook URL (#13)
    webhooks: WebhookOptions | None = None  # signing and retries of call webhooks; None: no webhooks
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)  # new streams refused while the
    # engines have no headroom (qasr.server.admission)
    worker: int | None = None  # front-end worker N of several on one port (qasr.server.workers): the port is bound
    # with SO_REUSEPORT and every handshake response says `X-Qasr-Worker: N/pid`; None: the only server process

    def __post_init__(self):
        if self.webhooks is None and (self.calls.webhook_url or self.calls.webhook_prefixes):
            raise ValueError("call webhooks need a signing secret (--webhook-secret or $QASR_WEBHOOK_SECRET)")
        try:
            self.stream_limits.check(self.defaults)
        except ValueError as error:
            raise ValueError(f"the default stream settings are outside the stream limits: {error}") from None


@dataclass(frozen=True)
class Handshake:
    """What a wire adapter is built from: the upgrade request (path, query, headers) and the server's settings."""

    request: Request
    config: ServerConfig
    model_name: str  # what clients are told; "" while no engine is loaded (the connection is then refused)
    calls: CallRegistry | None = None  # the server's calls, which telephony adapters publish to


# WebSocket path -> the wire adapter for its connections. Other wire formats register their paths here. An adapter
# is built when the handshake is checked: a ProtocolError from it refuses the upgrade (HTTP 400).
WIRE_ADAPTERS: dict[str, Callable[[Handshake], WireAdapter]] = {
    STREAM_PATH: lambda handshake: NativeProtocol(defaults=handshake.config.defaults,
                                                  stream_limits=handshake.config.stream_limits,
                                                  limits=handshake.config.limits),
    "/v1/realtime": lambda handshake: OpenAIRealtimeAdapter.for_query(  # ?intent=transcription
        urlsplit(handshake.request.path).query, defaults=handshake.config.defaults,
        limits=handshake.config.stream_limits, model_name=handshake.model_name),
    "/v1/listen": lambda handshake: DeepgramAdapter(urlsplit(handshake.request.path).query,
                                                    defaults=handshake.config.defaults,
                                                    limits=handshake.config.stream_limits),
    **TELEPHONY_ADAPTERS,  # /v1/twilio, /v1/telnyx, /v1/vonage, /v1/audiohook
}


class QasrServer:
    def __init__(self, engine: SpeechEngine | None = None, config: ServerConfig = ServerConfig(), *,
                 metrics: ServerMetrics | None = None, replica: ReplicaView | None = None):
        """engine: any SpeechEngine (started or not: /readyz follows engine.ready), or None until load_engine().
        replica: a front-end worker's view of its siblings and their engine (qasr.server.workers): /readyz and
        /healthz then answer for every process of the replica, and this one publishes its readiness there."""
        self.engine = engine
        self.replica = replica
        self.config = config
        self.metrics = metrics or ServerMetrics()
        self.admission = Admission(config.admission)  # refuses new streams past the engines' latency target
        self.connections: set[StreamConnection] = set()  # admitted streams
        self.stopping = False
        self._websocket_server: Server | None = None
        self.port: int | None = None  # once started
        self._stopped = asyncio.Event()
        self._handlers: set[asyncio.Task] = set()  # every WebSocket connection's handler: stop() waits for them
        self._loading: EngineLoad | None = None  # while load_engine() builds the engine
        self._warmed_up = engine is not None  # a given engine is the caller's to warm up; a loaded one, ours
        self._lag_watch: asyncio.Task | None = None
        self._adapters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # connection -> its adapter, from
        # the handshake until the connection's handler takes it
        self.key_usage = KeyUsage()  # per-key streams and audio (qasr.server.quotas)
        self.gate: HandshakeGate | None = None  # once started
        self.webhooks = (WebhookSender(config.webhooks, on_undelivered=self.metrics.webhook_undelivered)
                         if config.webhooks is not None else None)
        self.calls = CallRegistry(config.calls, webhooks=self.webhooks)  # telephony calls, their subscribers
        self.subscribers: set[CallSubscriber] = set()  # GET /v1/calls/{id}/events connections

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and serve. The HTTP endpoints answer at once; streams are admitted once the engine is ready."""
        limits = self.config.limits
        websocket_paths = WebSocketPaths(WIRE_ADAPTERS.keys())  # the streams' and the call subscribers'
        routes = HttpRoutes(metrics=self.metrics, engine=_EngineView(self), is_ready=self._replica_ready,
                            web_root=self.config.web_root, stream_paths=websocket_paths)
        routes = functools.partial(self._build_adapter, routes)  # the last step of every handshake
        security = self.config.security
        self.gate = HandshakeGate(security, routes, websocket_paths)  # origin, address limits, auth first
        self._websocket_server = await serve(
            self._handle, self.config.host, self.config.port, process_request=self.gate,
            max_size=limits.max_message_bytes, ping_interval=self.config.ping_interval_s,
            ping_timeout=self.config.ping_interval_s, create_connection=self.gate.connection_factory(),
            select_subprotocol=self.gate.select_subprotocol, ssl=security.ssl,
            reuse_port=self.config.worker is not None, process_response=self._tag_worker,
            compression=None)  # PCM barely compresses; inflating every frame was ~6% of the event loop at 500 streams
        self.port = self._websocket_server.sockets[0].getsockname()[1]  # the bound port (useful with port 0)
        log.info("listening on %s://%s:%d/v1/stream%s", "wss" if security.ssl else "ws", self.config.host, self.port,
                 "" if security.auth.required else " (no authentication)")
        self._lag_watch = asyncio.create_task(self._watch_loop_lag())

    async def load_engine(self, factory: Callable[[], SpeechEngine]) -> None:
        """Build the engine in a daemon thread (loading weights takes a while; a stop() meanwhile abandons it and
        the process may exit at once), start it, then serve one warm-up decode: /readyz says ready only after it,
        so the first client never pays the lazy imports and first-call costs of the decode path."""
        if self.stopping:
            return
        self._loading = EngineLoad(factory)
        try:
            engine = await self._loading.result()
        finally:
            self._loading = None
        if engine is None:  # abandoned by stop()
            return
        if self.stopping:
            await engine.close()
            return
        try:  # a server whose slots cannot hold its longest segment would refuse every start
            await engine.check_context("", language=None, max_audio_seconds=self.config.stream_limits.max_segment_s)
        except ValueError as error:
            await engine.close()
            raise ValueError(f"the engine's max_len cannot hold a {self.config.stream_limits.max_segment_s:g} s "
                             f"segment (raise --max-len or lower --max-segment-s): {error}") from None
        self.engine = engine  # from here stop() closes it (and /healthz sees its errors)
        await engine.start()
        try:
            await _warm_up(engine)
        except Exception as error:
            if self.stopping:  # stop() closed it under the warm-up
                return
            raise RuntimeError(f"the engine failed its warm-up decode: {type(error).__name__}: {error}") from error
        self._warmed_up = True
        log.info("engine ready: %s", engine.model_name)


    def is_ready(self) -> bool:
        """This process can take a stream now (its engine is ready, it is not stopping)."""
        return self.engine is not None and bool(self.engine.ready) and self._warmed_up and not self.stopping

    def _replica_ready(self) -> bool:
        """What /readyz says: this process, and with workers every sibling and the engine they share."""
        return self.is_ready() and (self.replica is None or self.replica.ready())

    def _tag_worker(self, connection: ServerConnection, request: Request, response: Response) -> None:
        """Which worker answered a handshake (the tests check that streams spread over the workers)."""
        if self.config.worker is not None:
            response.headers["X-Qasr-Worker"] = f"{self.config.worker}/{os.getpid()}"

    async def stop(self) -> None:
        """Refuse new streams, let every open stream receive its finals (within limits.drain_timeout_s), close
        them with 1001, close the engine, then the port. Meanwhile the port still answers HTTP (/healthz 200,
        /readyz 503) and refuses stream upgrades with 503, which a load balancer retries on another replica. An
        engine still loading is abandoned, not waited for. Idempotent; returns once everything is closed."""
        if self.stopping:
            await self._stopped.wait()
            return
        self.stopping = True
        if self._loading is not None:
            loaded = self._loading.abandon()
            if loaded is not None:
                await loaded.close()
        log.info("stopping: finalising %d open streams", len(self.connections))
        for connection in list(self.connections):
            connection.request_stop()
        for subscriber in list(self.subscribers):
            subscriber.request_stop()  # after its call's last finals, within the drain timeout
        while self._handlers:  # each ends within the drain timeout; one that began meanwhile is turned away
            await asyncio.wait(set(self._handlers))
        if self.webhooks is not None:
            await self.webhooks.close()  # queued call messages get their drain timeout
        if self._lag_watch is not None:
            self._lag_watch.cancel()
        if self.engine is not None:
            await self.engine.close()
        if self._websocket_server is not None:
            self._websocket_server.close()  # and 1001 for a handshake still under way
            await self._websocket_server.wait_closed()
        self._stopped.set()
        log.info("stopped")

    async def _watch_loop_lag(self, period_s: float = 0.1, tasks_every: int = 10) -> None:
        """A timer's lateness is what every stream's next frame waits: the event loop's own load. Every
        `tasks_every` periods it also counts the loop's tasks: with --workers, /metrics from one worker sums every
        worker's last value, and a count set only when a scrape reached that worker stayed as it was then (the
        600-stream H200 soak's idle server showed +824 tasks: other workers' counts from mid-run scrapes)."""
        loop = asyncio.get_running_loop()
        periods = 0
        while True:
            if self.replica is not None:  # the siblings read it for their /readyz
                self.replica.publish(self.is_ready())
            if periods % tasks_every == 0:
                self.metrics.event_loop_tasks.set(len(asyncio.all_tasks()))
            periods += 1
            start = loop.time()
            await asyncio.sleep(period_s)
            self.metrics.loop_lagged(max(0.0, loop.time() - start - period_s))

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # -- connections -----------------------------------------------------------------------------------------

    def _build_adapter(self, routes: Callable, connection: ServerConnection, request: Request) -> Response | None:
        """The HTTP routes answer what is not a WebSocket; a stream path's wire adapter is built from the handshake
        now, so that one that cannot serve it (a ProtocolError: a Deepgram query it cannot take, an OpenAI session
        that is not for transcription) refuses the upgrade with HTTP 400 (or the error's `http_status`)."""
        response = routes(connection, request)
        make_adapter = WIRE_ADAPTERS.get(urlsplit(request.path).path)
        if response is not None or make_adapter is None:
            return response
        if self.stopping or not self.is_ready():  # before the upgrade, so a load balancer can retry elsewhere
            self.metrics.stream_refused("shutting_down" if self.stopping else "not_ready")
            return _unavailable(connection, "the server is shutting down: connect again (another replica)"
                                if self.stopping else "the model is still loading: try again shortly")
        if not self.admission.admits(self.engine.stats()):  # the engines are at their latency target
            self.metrics.stream_refused("headroom")
            return _unavailable(connection, self.admission.refusal, retry_after_s=self.admission.retry_after_s)
        handshake = Handshake(request, self.config, self.engine.model_name if self.engine else "", calls=self.calls)
        try:
            self._adapters[connection] = make_adapter(handshake)
        except errors.ProtocolError as error:
            status = http.HTTPStatus(getattr(error, "http_status", http.HTTPStatus.BAD_REQUEST))
            log.info("handshake for %s refused: %d %s", urlsplit(request.path).path, status.value, error)
            return connection.respond(status, f"{error}\n")
        return None

    async def _handle(self, websocket: ServerConnection) -> None:
        handler = asyncio.current_task()
        self._handlers.add(handler)
        try:
            await self._serve(websocket)
        finally:
            self._handlers.discard(handler)

    async def _serve(self, websocket: ServerConnection) -> None:
        self.metrics.connections_total.inc()
        path = urlsplit(websocket.request.path).path
        if path not in WIRE_ADAPTERS:  # the gate let only these and subscriber paths in
            await self._serve_subscriber(websocket, call_id_of(path))
            return
        principal = self.gate.principal(websocket)
        adapter = GuardedAdapter(self._adapters.pop(websocket), principal=principal, usage=self.key_usage,
                                 limits=self.config.security.client_limits)  # the adapter _build_adapter made
        connection = StreamConnection(websocket, adapter, engine=self.engine, limits=self.config.limits,
                                      metrics=self.metrics)
        try:
            await connection.run(admit=functools.partial(self._admit, connection, principal))
        finally:
            if connection in self.connections:
                self.key_usage.close_stream(principal)
            self.connections.discard(connection)

    async def _serve_subscriber(self, websocket: ServerConnection, call_id: str) -> None:
        subscriber = CallSubscriber(websocket, self.calls, call_id, drain_timeout_s=self.config.limits.drain_timeout_s)
        if self.stopping:
            subscriber.request_stop()
        self.subscribers.add(subscriber)
        try:
            await subscriber.run()
        finally:
            self.subscribers.discard(subscriber)

    def _admit(self, connection: StreamConnection, principal) -> None:
        if self.stopping:
            self.metrics.stream_refused("shutting_down")
            raise errors.ShuttingDown("server is shutting down")
        if not self.is_ready():
            self.metrics.stream_refused("not_ready")
            raise errors.NotReady("the model is still loading: try again shortly")
        if len(self.connections) >= self.config.limits.max_sessions:
            self.metrics.stream_refused("max_sessions")
            raise errors.ServerFull(f"the server is full ({self.config.limits.max_sessions} streams): "
                                    "try again later")
        if not self.admission.admits(self.engine.stats()):  # it changed since the handshake: 1013, retry hint
            self.metrics.stream_refused("headroom")
            raise errors.ServerFull(self.admission.refusal)
        self.key_usage.open_stream(principal)  # LimitExceeded (1008) past the key's concurrent streams
        connection.engine = self.engine
        self.connections.add(connection)



RETRY_AFTER_S = 1  # what a 503'd handshake tells the client to wait


def _unavailable(connection: ServerConnection, reason: str, *, retry_after_s: int = RETRY_AFTER_S) -> Response:
    """HTTP 503 for a stream upgrade the server cannot take now (loading, shutting down, no headroom)."""
    log.info("handshake refused: 503 %s", reason)
    response = connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, f"{reason}\n")
    response.headers["Retry-After"] = str(retry_after_s)
    return response


async def _warm_up(engine: SpeechEngine) -> None:
    """One short decode through the whole path (mel, encoder, prefill, decode) before the first client's; an engine
    pool gets one per engine (concurrent new streams are placed one per engine)."""
    audio = np.random.default_rng(0).normal(0.0, 0.05, 16000).astype(np.float32)  # 1 s of quiet noise
    engines = max(1, len(engine.stats().get("engines", ())))
    streams = [WARM_UP_STREAM] + [f"{WARM_UP_STREAM}/{i}" for i in range(1, engines)]
    try:
        await asyncio.gather(*(engine.transcribe(DecodeRequest(audio=audio, stream_id=stream, max_new_tokens=4))
                               for stream in streams))
    finally:
        for stream in streams:
            engine.release_stream(stream)
    forget = getattr(engine, "forget_recent_finals", None)  # a pool: its first-use costs are not the load
    if forget is not None:
        forget()


class _EngineView:
    """What /metrics reads of the engine, which may not exist yet while the model loads."""

    def __init__(self, server: QasrServer):
        self._server = server

    @property
    def ready(self) -> bool:
        return self._server.is_ready()

    @property
    def error(self) -> BaseException | None:
        """Set when the engine loop or its process died: the server is no longer healthy (orchestrators should
        restart it)."""
        engine = self._server.engine
        error = engine.error if engine is not None else None
        replica = self._server.replica
        return error if error is not None or replica is None else replica.error()

    def stats(self) -> dict:
        engine = self._server.engine
        return engine.stats() if engine is not None else {}
