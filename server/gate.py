"""The handshake gate: what every WebSocket connection passes before it is a stream, and POST /v1/tokens.

In order, for a stream path (any wire adapter's):

    TCP accept      more than max_pending_per_address connections from the peer still in their handshake: an
                    HTTP 429 is written and the connection half-closed, its request discarded unread, and closed
                    when the client closes (at most REFUSED_LINGER_S later): slow or idle handshakes cannot pile
                    up; each is also bounded by websockets' open timeout, 10 s
    request read    Origin not allowed (browsers only; clients without an Origin pass)       -> 403
                    max_connections_per_address open connections from the client's address  -> 429
                    no valid credential where authentication is required (qasr.server.auth)  -> 401
    accepted        the subprotocol that carried the credential (or "realtime") is echoed; the connection keeps its
                    Principal (per-key limits: qasr.server.quotas)

The peer address is the TCP peer; behind a trusted proxy (`trusted_proxies`) the client's address is the last
X-Forwarded-For hop that is not itself a trusted proxy. X-Forwarded-For from anyone else is ignored: a client could
otherwise claim any address. Connections from a trusted proxy are not limited at accept (the proxy's own limits
apply there); their clients are, by address, once the request is read.
"""

from __future__ import annotations

import asyncio
import http
import ipaddress
import json
import logging
from collections import Counter
from typing import Callable, Collection
from urllib.parse import urlsplit

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from qasr.server.auth import ANONYMOUS, AuthError, Principal, choose_subprotocol, offered_subprotocols
from qasr.server.connection import PingAwareConnection
from qasr.server.security import SecuritySettings

log = logging.getLogger("qasr.server")

TOKENS_PATH = "/v1/tokens"
REFUSED_LINGER_S = 2.0  # a connection refused at accept is closed this long after its 429, unless its client closed


class AddressBook:
    """Connections per address: still in their handshake (by TCP peer) and open (by client address)."""

    def __init__(self):
        self.pending: Counter[str] = Counter()
        self.open: Counter[str] = Counter()

    def add(self, counter: Counter, address: str) -> None:
        counter[address] += 1

    def remove(self, counter: Counter, address: str) -> None:
        counter[address] -= 1
        if counter[address] <= 0:
            del counter[address]


class HandshakeGate:
    """websockets' process_request for the whole port: the gate for stream paths and /v1/tokens, then `routes`
    (qasr.server.http.HttpRoutes) for everything else."""

    def __init__(self, settings: SecuritySettings, routes: Callable[[object, Request], Response | None],
                 stream_paths: Collection[str]):
        self.settings = settings
        self.routes = routes
        self.stream_paths = stream_paths
        self.addresses = AddressBook()

    def __call__(self, connection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path == TOKENS_PATH:
            return self._mint(connection, request)
        if path not in self.stream_paths:
            return self.routes(connection, request)
        address = self.client_address(connection, request)
        origin = request.headers.get("Origin")
        if origin is not None and not self.origin_allowed(origin, request.headers.get("Host")):
            return self._refuse(connection, address, http.HTTPStatus.FORBIDDEN,
                                f"origin {origin} is not allowed (--allowed-origins)")
        limit = self.settings.max_connections_per_address
        if limit is not None and self.addresses.open[address] >= limit:
            return self._refuse(connection, address, http.HTTPStatus.TOO_MANY_REQUESTS,
                                f"{limit} connections from your address are open (the limit per address)")
        try:
            principal = self.settings.auth.authenticate(request.path, request.headers)
        except AuthError as error:
            return self._refuse(connection, address, error.status, str(error))
        if isinstance(connection, GatedConnection):
            connection.admitted(principal, address)
        if principal.name is not None:
            log.debug("key %s authenticated by %s from %s", principal.name, principal.via, address)
        return self.routes(connection, request)

    def select_subprotocol(self, connection, offered: list[str]) -> str | None:
        return choose_subprotocol(list(offered))

    def connection_factory(self, base: type[PingAwareConnection] = PingAwareConnection):
        """create_connection for websockets' serve: connections that count themselves per address."""
        gate = self

        def create(*args, **kwargs) -> GatedConnection:
            return GatedConnection(*args, gate=gate, **kwargs)

        return create

    def principal(self, connection) -> Principal:
        return getattr(connection, "principal", ANONYMOUS)

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        allowed = self.settings.allowed_origins
        if allowed is None or "*" in allowed:
            return True
        origin = origin.strip().lower().rstrip("/")
        if origin in allowed:
            return True
        return host is not None and urlsplit(origin).netloc == host.strip().lower()  # the server's own page

    def client_address(self, connection, request: Request) -> str:
        peer = peer_address(connection)
        trusted = self.settings.trusted_proxies
        if not _within(peer, trusted):
            return peer
        hops = [hop.strip() for value in request.headers.get_all("X-Forwarded-For") for hop in value.split(",")]
        for hop in reversed([hop for hop in hops if hop]):
            if not _within(hop, trusted):
                return hop
        return peer

    def _mint(self, connection, request: Request) -> Response:
        if request.method != "POST":
            return _json(http.HTTPStatus.METHOD_NOT_ALLOWED, {"error": "POST a key to mint a token"},
                         extra={"Allow": "POST"})
        try:
            body = self.settings.auth.mint(request.path, request.headers)
        except AuthError as error:
            log.info("token refused for %s: %s", peer_address(connection), error)
            return _json(error.status, {"error": str(error)}, extra=_challenge(error.status))
        return _json(http.HTTPStatus.OK, body, extra={"Cache-Control": "no-store"})

    def _refuse(self, connection, address: str, status: http.HTTPStatus, message: str) -> Response:
        log.info("handshake from %s refused: %d %s", address, status.value, message)
        response = connection.respond(status, message + "\n")
        for name, value in _challenge(status).items():
            response.headers[name] = value
        return response


class GatedConnection(PingAwareConnection):
    """A server connection that counts itself against its address's limits from TCP accept to close."""

    def __init__(self, *args, gate: HandshakeGate, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.principal: Principal = ANONYMOUS
        self.peer = "?"
        self._pending = False  # counted in addresses.pending
        self._open_address: str | None = None  # counted in addresses.open
        self._refused = False  # answered 429 at accept: what arrives is discarded until the client closes
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.peer = peer_address(self)
        settings, book = self.gate.settings, self.gate.addresses
        if _within(self.peer, settings.trusted_proxies):
            return
        if book.pending[self.peer] >= settings.max_pending_per_address:
            log.info("connection from %s refused: %d handshakes already pending from it", self.peer,
                     book.pending[self.peer])
            body = (f"too many connections from your address are still in their handshake (the limit is "
                    f"{settings.max_pending_per_address})\n").encode()
            transport.write(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: text/plain; charset=utf-8\r\n"
                            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            self._refuse_at_accept(transport)
            return
        book.add(book.pending, self.peer)
        self._pending = True

    def _refuse_at_accept(self, transport) -> None:
        """After the 429: half-close, discard what the client sends, and close once it has closed (or after
        REFUSED_LINGER_S). Closing at once, with its request already received and unread, made the kernel reset the
        connection (RST, not FIN), and a reset can destroy the 429 before the client reads it: the client saw a
        connection dropped without an HTTP answer."""
        self._refused = True
        if transport.can_write_eof():
            transport.write_eof()
        self._linger = self.loop.call_later(REFUSED_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if not self._refused:  # a refused connection's request is read and dropped, never parsed
            super().data_received(data)

    def eof_received(self) -> bool | None:
        if self._refused:
            return None  # the client has read the 429 and closed: the transport closes
        return super().eof_received()

    async def handshake(self, *args, **kwargs) -> None:
        try:
            await super().handshake(*args, **kwargs)
        finally:
            self._end_pending()

    def admitted(self, principal: Principal, address: str) -> None:
        """The gate let the request through: count it as open for its client address until it closes."""
        self.principal = principal
        if self._open_address is None:
            self._open_address = address
            self.gate.addresses.add(self.gate.addresses.open, address)

    def connection_lost(self, exc) -> None:
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)
        self._end_pending()
        if self._open_address is not None:
            self.gate.addresses.remove(self.gate.addresses.open, self._open_address)
            self._open_address = None

    def _end_pending(self) -> None:
        if self._pending:
            self._pending = False
            self.gate.addresses.remove(self.gate.addresses.pending, self.peer)


def peer_address(connection) -> str:
    transport = getattr(connection, "transport", None)
    peer = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return str(peer or "unix")


def _within(address: str, networks) -> bool:
    if not networks:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)


def _challenge(status: http.HTTPStatus) -> dict[str, str]:
    return {"WWW-Authenticate": 'Bearer realm="qasr"'} if status == http.HTTPStatus.UNAUTHORIZED else {}


def _json(status: http.HTTPStatus, body: dict, *, extra: dict[str, str] | None = None) -> Response:
    data = json.dumps(body).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                       ("Connection", "close"), *(extra or {}).items()])
    return Response(status.value, status.phrase, headers, data)
