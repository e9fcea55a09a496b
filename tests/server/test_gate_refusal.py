"""A connection refused at TCP accept (too many handshakes pending from its address) gets its HTTP 429 and a clean
close, even when its request had already arrived: the server must never drop a connection without an HTTP answer.

Closing a socket whose received data is unread makes the kernel reset the connection (RST) instead of ending it
(FIN), and a reset may destroy the 429 before the client reads it (a client then sees no valid HTTP response)."""

from __future__ import annotations

import asyncio
import socket

from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from qasr.server.app import QasrServer, ServerConfig
from qasr.server.security import SecuritySettings

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine

REQUEST = (b"GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


async def read_to_the_end(sock: socket.socket, timeout: float = 5.0) -> tuple[bytes, str]:
    """Everything the server sent, and how the connection ended: 'EOF' (FIN) or 'RESET' (RST)."""
    sock.setblocking(False)
    received, deadline = b"", asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        try:
            chunk = sock.recv(65536)
        except BlockingIOError:
            await asyncio.sleep(0.02)
            continue
        except ConnectionResetError:
            return received, "RESET"
        if not chunk:
            return received, "EOF"
        received += chunk
    return received, "still open"


def test_a_handshake_refused_at_accept_gets_its_429_and_a_clean_close():
    async def main():
        server = QasrServer(FakeEngine(), ServerConfig(port=0, ping_interval_s=None,
                                                       security=SecuritySettings(max_pending_per_address=1)))
        await server.start()
        try:
            idle = socket.create_connection(("127.0.0.1", server.port))  # the one pending handshake allowed
            await asyncio.sleep(0.2)
            refused = socket.create_connection(("127.0.0.1", server.port))
            refused.sendall(REQUEST)  # already there when the server accepts the connection
            answer, end = await read_to_the_end(refused)
            refused.close()
            with_client = None
            try:  # what websockets' client makes of it
                async with connect(f"ws://127.0.0.1:{server.port}/v1/stream", open_timeout=5):
                    pass
            except InvalidStatus as error:
                with_client = error.response.status_code
            idle.close()
            await asyncio.sleep(0.1)
            return answer, end, with_client, dict(server.gate.addresses.pending)
        finally:
            await server.stop()

    answer, end, with_client, pending = asyncio.run(asyncio.wait_for(main(), 30))
    assert answer.startswith(b"HTTP/1.1 429 ") and answer.endswith(b"still in their handshake (the limit is 1)\n")
    assert end == "EOF"  # not a reset
    assert with_client == 429 and pending == {}


def test_a_refused_client_that_never_closes_is_closed_after_the_linger(monkeypatch):
    monkeypatch.setattr("qasr.server.gate.REFUSED_LINGER_S", 0.3)

    async def main():
        server = QasrServer(FakeEngine(), ServerConfig(port=0, ping_interval_s=None,
                                                       security=SecuritySettings(max_pending_per_address=1)))
        await server.start()
        try:
            idle = socket.create_connection(("127.0.0.1", server.port))
            await asyncio.sleep(0.2)
            refused = socket.create_connection(("127.0.0.1", server.port))
            refused.sendall(REQUEST)
            await asyncio.sleep(1.0)  # reads nothing and keeps its side open meanwhile
            try:  # while the server lingers, late bytes are read and dropped; once it has closed, they are reset
                for _ in range(3):
                    refused.sendall(b"more bytes")
                    await asyncio.sleep(0.1)
                outcome = "accepted"
            except (BrokenPipeError, ConnectionResetError):
                outcome = "reset"
            refused.close()
            idle.close()
            return outcome
        finally:
            await server.stop()

    assert asyncio.run(asyncio.wait_for(main(), 30)) == "reset"
