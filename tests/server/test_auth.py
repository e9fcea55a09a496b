"""Authentication, per-key and per-client limits, the Origin allow-list and per-address limits: the pieces alone
(sans-I/O, fake clocks) and a server over real sockets on a fake engine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http
import json
import socket
import types

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed, InvalidStatus

from qasr.server import auth, security
from qasr.server.app import QasrServer, ServerConfig
from qasr.server.auth import (ANONYMOUS, AuthError, Authenticator, KeyLimits, KeyStore, TokenSigner, hash_key,
                              parse_key_line)
from qasr.server.commands import Audio, Start
from qasr.server.gate import HandshakeGate
from qasr.server.limits import ServerLimits
from qasr.server.quotas import ClientLimits, GuardedAdapter, KeyUsage, LimitExceeded
from qasr.server.security import SecuritySettings
from qasr.streaming.settings import StreamSettings

from fakes import FakeEngine, speech_like, to_s16le

KEY, OTHER_KEY = "k" * 20 + "-alpha", "k" * 20 + "-beta"
START = json.dumps({"type": "start"})


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def store(*lines: str) -> KeyStore:
    return KeyStore([key for line in lines if (key := parse_key_line(line)) is not None])


def keys_store(**limits) -> KeyStore:
    return store(f"{hash_key(KEY)} name=alpha " + " ".join(f"{k}={v}" for k, v in limits.items()),
                 f"{hash_key(OTHER_KEY)} name=beta")


def authenticator(**limits) -> Authenticator:
    return Authenticator(keys_store(**limits), TokenSigner(b"s" * 32), required=True)


# -- keys, tokens, credentials --------------------------------------------------------------------------------

def test_the_key_file_holds_digests_with_optional_names_and_limits():
    key = parse_key_line(f"{hash_key(KEY)} name=acme max_streams=3 audio_seconds_per_minute=90  # ops team")
    assert (key.name, key.limits) == ("acme", KeyLimits(max_streams=3, audio_seconds_per_minute=90.0))
    assert parse_key_line("  # a comment") is None and parse_key_line("") is None
    unnamed = parse_key_line(hash_key(KEY), KeyLimits(max_streams=5))
    assert unnamed.name == "key-" + hash_key(KEY)[7:15] and unnamed.limits.max_streams == 5
    with pytest.raises(ValueError, match="stored hashed"):
        parse_key_line(KEY)  # a plain key in the file
    with pytest.raises(ValueError, match="64 hex"):
        parse_key_line("sha256:abcd")
    with pytest.raises(ValueError, match="unknown option"):
        parse_key_line(f"{hash_key(KEY)} streams=3")
    with pytest.raises(ValueError, match="max_streams must be >= 1"):
        parse_key_line(f"{hash_key(KEY)} max_streams=0")


def test_keys_load_from_a_file_and_the_environment_and_are_found_by_digest(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# keys\n{hash_key(KEY)} name=alpha\n")
    keys = KeyStore.load(path, env_value=f" {OTHER_KEY} ,")
    assert len(keys) == 2
    assert keys.find(KEY).name == "alpha" and keys.find(OTHER_KEY).name.startswith("key-")
    assert keys.find(KEY + "x") is None and keys.find("") is None
    assert KEY not in path.read_text()
    with pytest.raises(ValueError, match="line 1"):
        (tmp_path / "bad").write_text(KEY + "\n")
        KeyStore.load(tmp_path / "bad")
    with pytest.raises(ValueError, match="at least 16"):
        KeyStore.load(env_value="short")
    with pytest.raises(ValueError, match="missing"):
        KeyStore.load(tmp_path / "missing")


def test_tokens_carry_their_key_until_they_expire_and_cannot_be_forged():
    clock = Clock()
    signer = TokenSigner(b"s" * 32, max_ttl_s=300, clock=clock)
    token, expires = signer.mint("alpha", 60)
    assert expires == 1060 and signer.verify(token) == "alpha"
    version, payload, signature = token.split(".")
    forged_payload = auth._b64(json.dumps({"k": "beta", "e": expires}).encode())
    for forged in (f"{version}.{forged_payload}.{signature}", f"{version}.{payload}.{signature[:-2]}AA",
                   "v1.garbage", "not-a-token"):
        with pytest.raises(AuthError):
            signer.verify(forged)
    with pytest.raises(AuthError):  # another server's secret
        TokenSigner(b"t" * 32, clock=clock).verify(token)
    clock.now = 1060
    with pytest.raises(AuthError, match="expired"):
        signer.verify(token)
    with pytest.raises(ValueError, match="ttl_s"):
        signer.mint("alpha", 301)


@pytest.mark.parametrize("headers, via", [
    ({"Authorization": f"Bearer {KEY}"}, "header"),
    ({"authorization": f"bEaReR   {KEY}"}, "header"),
    ({"Authorization": f"Token {KEY}"}, "header"),
    ({"X-API-KEY": KEY}, "header"),
    ({"Sec-WebSocket-Protocol": f"qasr.key.{KEY}"}, "subprotocol"),
    ({"Sec-WebSocket-Protocol": f"realtime, openai-insecure-api-key.{KEY}, openai-beta.realtime-v1"}, "subprotocol"),
    ({"Sec-WebSocket-Protocol": f"token, {KEY}"}, "subprotocol"),
])
def test_a_key_is_accepted_in_every_style_a_client_can_send(headers, via):
    principal = authenticator(max_streams=2).authenticate("/v1/stream", Headers(headers))
    assert principal.name == "alpha" and principal.via == via and principal.limits.max_streams == 2


def test_tokens_are_accepted_as_a_subprotocol_a_header_or_in_the_url_but_keys_never_in_a_url():
    gate = authenticator()
    token = gate.signer.mint("beta", 60)[0]
    for path, headers in (("/v1/stream", {"Sec-WebSocket-Protocol": f"qasr.token.{token}"}),
                          (f"/v1/twilio?token={token}", {}), ("/v1/stream", {"Authorization": f"Bearer {token}"})):
        assert gate.authenticate(path, Headers(headers)) == auth.Principal("beta", KeyLimits(), "token")
    with pytest.raises(AuthError, match="never go in a URL"):
        gate.authenticate(f"/v1/stream?api_key={KEY}", Headers())
    with pytest.raises(AuthError, match="not a qasr token"):  # a valid key where only a token may be
        gate.authenticate(f"/v1/stream?token={KEY}", Headers())


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer " + "x" * 20}, {"Authorization": "Basic abc"},
                                     {"Sec-WebSocket-Protocol": "qasr.key.nope"}, {"X-API-KEY": OTHER_KEY + "!"}])
def test_a_missing_or_wrong_credential_is_a_401_that_never_echoes_it(headers):
    with pytest.raises(AuthError) as refused:
        authenticator().authenticate("/v1/stream", Headers(headers))
    assert refused.value.status == http.HTTPStatus.UNAUTHORIZED
    assert "x" * 20 not in str(refused.value) and "nope" not in str(refused.value)


def test_authentication_off_reads_no_credential():
    off = Authenticator(keys_store(), required=False)
    assert off.authenticate("/v1/stream", Headers({"Authorization": "Basic zzz"})) is ANONYMOUS
    with pytest.raises(ValueError, match="no API keys"):
        Authenticator(KeyStore(), required=True)


def test_the_echoed_subprotocol_is_the_applications_or_the_one_that_carried_the_credential():
    assert auth.choose_subprotocol(["openai-insecure-api-key.K", "realtime"]) == "realtime"
    assert auth.choose_subprotocol(["token", "K"]) == "token"
    assert auth.choose_subprotocol(["qasr.token.v1.a.b"]) == "qasr.token.v1.a.b"
    assert auth.choose_subprotocol(["chat"]) is None and auth.choose_subprotocol([]) is None


def cli_args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    security.add_arguments(parser)
    args = parser.parse_args([])
    vars(args).update(overrides)
    return args


def test_keys_are_required_off_loopback_unless_auth_none(tmp_path):
    assert not security.from_args(cli_args(), environ={}).auth.required
    assert security.from_args(cli_args(), environ={"QASR_API_KEYS": KEY}).auth.required  # keys given: used
    with pytest.raises(ValueError, match="not a loopback address"):
        security.from_args(cli_args(host="0.0.0.0"), environ={})
    assert not security.from_args(cli_args(host="0.0.0.0", auth="none"), environ={}).auth.required
    with pytest.raises(ValueError, match="no API keys|needs API keys|not a loopback"):
        security.from_args(cli_args(auth="keys"), environ={})
    with pytest.raises(ValueError, match="--trusted-proxies"):
        security.from_args(cli_args(trusted_proxies="10.0.0.0/8,nonsense"), environ={})
    with pytest.raises(ValueError, match="--ssl-keyfile needs"):
        security.from_args(cli_args(ssl_keyfile=str(tmp_path / "k.pem")), environ={})


# -- limits, sans-I/O ------------------------------------------------------------------------------------------

def test_a_keys_concurrent_streams_and_audio_per_minute_are_shared_by_its_connections():
    clock = Clock()
    usage = KeyUsage(clock=clock)
    alpha = auth.Principal("alpha", KeyLimits(max_streams=2, audio_seconds_per_minute=100))
    usage.open_stream(alpha)
    usage.open_stream(alpha)
    with pytest.raises(LimitExceeded) as over:
        usage.open_stream(alpha)
    assert over.value.error_code == "key_stream_limit" and over.value.close_code == 1008
    usage.close_stream(alpha)
    usage.open_stream(alpha)  # a slot came back
    usage.add_audio(alpha, 60)
    clock.now += 30
    usage.add_audio(alpha, 40)  # 100 s within the minute: at the limit, not over
    with pytest.raises(LimitExceeded) as over:
        usage.add_audio(alpha, 1)
    assert over.value.error_code == "key_audio_limit"
    clock.now += 31  # the first 60 s left the window
    usage.add_audio(alpha, 50)
    assert usage.audio_last_minute("alpha") == pytest.approx(91)
    for _ in range(10):
        usage.open_stream(ANONYMOUS)  # no key, no key limits


class EchoAdapter:
    """A stand-in wire adapter: text starts a 1 kHz stream, bytes are samples (one byte each)."""

    def greeting(self):
        return ["hello"]

    def receive(self, message):
        if isinstance(message, str):
            return [Start(StreamSettings(sample_rate=8000))]
        return [Audio(np.zeros((len(message), 1), np.float32))]

    def encode(self, event):
        return [repr(event)]

    def close(self):
        return "closed"


def test_the_guard_limits_a_connections_message_rate_and_its_streams_total_audio():
    clock = Clock()
    guarded = GuardedAdapter(EchoAdapter(), principal=ANONYMOUS, usage=KeyUsage(clock),
                             limits=ClientLimits(max_messages_per_s=10, message_burst=5, max_stream_audio_s=2.0),
                             clock=clock)
    assert guarded.greeting() == ["hello"] and guarded.close() == "closed"  # the adapter's own
    guarded.receive("start")
    for _ in range(4):
        guarded.receive(b"\0" * 100)
    with pytest.raises(LimitExceeded) as over:
        guarded.receive(b"")
    assert over.value.error_code == "rate_limited"
    clock.now += 0.5  # 5 messages' worth of rate
    for _ in range(5):
        guarded.receive(b"\0" * 100)
    clock.now += 10
    guarded.receive(b"\0" * 14000)  # with the 900 samples before: 1.8625 s at 8 kHz, under 2 s
    assert guarded.audio_s == pytest.approx(14900 / 8000)
    with pytest.raises(LimitExceeded) as over:
        guarded.receive(b"\0" * 2000)
    assert over.value.error_code == "stream_audio_limit" and "2 s" in str(over.value)


def test_x_forwarded_for_is_believed_only_from_trusted_proxies():
    import ipaddress

    settings = SecuritySettings(trusted_proxies=(ipaddress.ip_network("10.0.0.0/8"),))
    gate = HandshakeGate(settings, lambda connection, request: None, {"/v1/stream"})

    def address(peer, forwarded):
        connection = types.SimpleNamespace(transport=types.SimpleNamespace(get_extra_info=lambda _: (peer, 1)))
        request = types.SimpleNamespace(headers=Headers([("X-Forwarded-For", value) for value in forwarded]))
        return gate.client_address(connection, request)

    assert address("203.0.113.9", ["198.51.100.1"]) == "203.0.113.9"  # not a proxy: its claim is ignored
    assert address("10.0.0.2", ["198.51.100.1, 10.0.0.7"]) == "198.51.100.1"
    assert address("10.0.0.2", ["6.6.6.6, 198.51.100.1", "10.1.1.1"]) == "198.51.100.1"  # spoofed hop left of it
    assert address("10.0.0.2", []) == "10.0.0.2"


# -- over real sockets ---------------------------------------------------------------------------------------

def run(coroutine, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


@contextlib.asynccontextmanager
async def secured(settings: SecuritySettings, **limits):
    engine = FakeEngine(delay_s=0.005)
    server = QasrServer(engine, ServerConfig(port=0, limits=ServerLimits(**limits), ping_interval_s=None,
                                             security=settings))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def url(server: QasrServer, path: str = "/v1/stream") -> str:
    return f"ws://127.0.0.1:{server.port}{path}"


async def read_all(websocket) -> list[dict]:
    out = []
    with contextlib.suppress(ConnectionClosed):
        async for message in websocket:
            out.append(json.loads(message))
    return out


async def refused_status(server, **connect_kwargs) -> tuple[int, bytes]:
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url(server), **connect_kwargs):
            pass
    return refused.value.response.status_code, refused.value.response.body


async def raw_http(server, request: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(request.encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_a_stream_without_a_valid_key_is_refused_401_at_the_handshake_and_a_keyed_one_streams():
    async def main():
        async with secured(SecuritySettings(auth=authenticator())) as server:
            missing = await refused_status(server)
            wrong = await refused_status(server, additional_headers={"Authorization": "Bearer " + "w" * 20})
            assert server.engine.calls == [] and not server.connections  # nothing was read or opened
            async with connect(url(server), additional_headers={"Authorization": f"Bearer {KEY}"}) as websocket:
                await websocket.send(START)
                ready = json.loads(await websocket.recv())
            async with connect(url(server), subprotocols=[f"qasr.key.{OTHER_KEY}"]) as websocket:
                echoed = websocket.subprotocol
                await websocket.send(START)
                ready_too = json.loads(await websocket.recv())
            return missing, wrong, ready, echoed, ready_too

    missing, wrong, ready, echoed, ready_too = run(main())
    assert missing[0] == 401 and b"API key is required" in missing[1]
    assert wrong[0] == 401 and b"not valid" in wrong[1]
    assert ready["type"] == "ready" and ready_too["type"] == "ready"
    assert echoed == f"qasr.key.{OTHER_KEY}"  # a browser fails the connection unless its subprotocol comes back


def test_a_backend_mints_a_short_lived_token_that_a_browser_streams_with():
    async def main():
        async with secured(SecuritySettings(auth=authenticator())) as server:
            no_key = await raw_http(server, "POST /v1/tokens HTTP/1.1\r\nHost: x\r\n\r\n")
            get = await raw_http(server, f"GET /v1/tokens HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n")
            status, body = await raw_http(server, f"POST /v1/tokens?ttl_s=30 HTTP/1.1\r\nHost: x\r\n"
                                                  f"Authorization: Bearer {KEY}\r\nContent-Length: 0\r\n\r\n")
            minted = json.loads(body)
            token_cannot_mint = await raw_http(server, f"POST /v1/tokens HTTP/1.1\r\nHost: x\r\n"
                                                       f"Authorization: Bearer {minted['token']}\r\n\r\n")
            async with connect(url(server), subprotocols=[minted["subprotocol"]]) as websocket:
                echoed = websocket.subprotocol
                await websocket.send(START)
                ready = json.loads(await websocket.recv())
            async with connect(url(server) + f"?token={minted['token']}") as websocket:
                await websocket.send(START)
                ready_by_url = json.loads(await websocket.recv())
            return no_key, get, status, minted, token_cannot_mint, echoed, ready, ready_by_url

    no_key, get, status, minted, token_cannot_mint, echoed, ready, ready_by_url = run(main())
    assert no_key[0] == 401 and get[0] == 405 and token_cannot_mint[0] == 401
    assert status == 200 and minted["key"] == "alpha" and minted["subprotocol"] == "qasr.token." + minted["token"]
    assert echoed == minted["subprotocol"]
    assert ready["type"] == ready_by_url["type"] == "ready"


def test_origins_outside_the_allow_list_get_403_and_non_browser_clients_pass():
    settings = SecuritySettings(allowed_origins=frozenset({"https://app.example.com"}))

    async def main():
        async with secured(settings) as server:
            foreign = await refused_status(server, origin="https://evil.example.net")
            async with connect(url(server), origin="https://app.example.com") as websocket:
                await websocket.send(START)
                allowed = json.loads(await websocket.recv())
            async with connect(url(server), origin=f"http://127.0.0.1:{server.port}") as websocket:  # its own page
                await websocket.send(START)
                own = json.loads(await websocket.recv())
            async with connect(url(server)) as websocket:
                await websocket.send(START)
                no_origin = json.loads(await websocket.recv())
            return foreign, allowed, own, no_origin

    foreign, *readies = run(main())
    assert foreign[0] == 403 and b"evil.example.net is not allowed" in foreign[1]
    assert [event["type"] for event in readies] == ["ready"] * 3


def test_a_keys_second_stream_over_its_limit_closes_1008_naming_the_limit():
    async def main():
        async with secured(SecuritySettings(auth=authenticator(max_streams=1))) as server:
            async with connect(url(server), additional_headers={"Authorization": f"Bearer {KEY}"}) as first:
                await first.send(START)
                await first.recv()
                async with connect(url(server), additional_headers={"Authorization": f"Bearer {KEY}"}) as second:
                    with contextlib.suppress(ConnectionClosed):  # turned away before its start is read
                        await second.send(START)
                    refused = await read_all(second)
                    code, reason = second.close_code, second.close_reason
                async with connect(url(server), additional_headers={"Authorization": f"Bearer {OTHER_KEY}"}) as other:
                    await other.send(START)
                    other_ready = json.loads(await other.recv())
            async with connect(url(server), additional_headers={"Authorization": f"Bearer {KEY}"}) as again:
                await again.send(START)  # the first closed: its slot came back
                again_ready = json.loads(await again.recv())
            return refused, code, reason, other_ready, again_ready

    refused, code, reason, other_ready, again_ready = run(main())
    assert (code, reason) == (1008, "key_stream_limit")
    assert refused[-1]["code"] == "key_stream_limit" and "1 open streams" in refused[-1]["message"]
    assert other_ready["type"] == again_ready["type"] == "ready"


def error_codes(out: list[dict]) -> list[str]:
    return [event["code"] for event in out if event["type"] == "error"]


async def stream_audio(server, audio: bytes, *, chunk: int = 3200, headers=None, pace_s: float = 0.0):
    async with connect(url(server), additional_headers=headers or {}) as websocket:
        await websocket.send(START)
        receiving = asyncio.ensure_future(read_all(websocket))
        with contextlib.suppress(ConnectionClosed):
            for offset in range(0, len(audio), chunk):
                await websocket.send(audio[offset:offset + chunk])
                await asyncio.sleep(pace_s)
            await websocket.send('{"type": "end"}')
        return await receiving, websocket.close_code, websocket.close_reason


def test_audio_over_a_keys_per_minute_limit_closes_the_stream_1008_after_its_finals():
    audio, _ = speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.8), ("speech", 2.0)])

    async def main():
        async with secured(SecuritySettings(auth=authenticator(audio_seconds_per_minute=2.5))) as server:
            return await stream_audio(server, to_s16le(audio), headers={"Authorization": f"Bearer {KEY}"},
                                      pace_s=0.005)

    out, code, reason = run(main())
    assert (code, reason) == (1008, "key_audio_limit")
    errors = [event for event in out if event["type"] == "error"]
    assert errors[0]["code"] == "key_audio_limit" and "2.5 s" in errors[0]["message"]
    assert [event["type"] for event in out if event["type"] == "final"]  # the first segment was delivered


def test_a_client_sending_too_many_messages_is_closed_1008_rate_limited():
    limits = ClientLimits(max_messages_per_s=20, message_burst=10)

    async def main():
        async with secured(SecuritySettings(client_limits=limits)) as server:
            return await stream_audio(server, b"\0\0" * 1600, chunk=32)  # 100 tiny frames at once

    out, code, reason = run(main())
    assert (code, reason) == (1008, "rate_limited") and error_codes(out) == ["rate_limited"]


def test_a_stream_over_its_total_audio_is_closed_1008():
    async def main():
        async with secured(SecuritySettings(client_limits=ClientLimits(max_stream_audio_s=1.0))) as server:
            return await stream_audio(server, b"\0\0" * 32000)  # 2 s

    out, code, reason = run(main())
    assert (code, reason) == (1008, "stream_audio_limit") and error_codes(out) == ["stream_audio_limit"]
    assert "1 s of audio" in next(event["message"] for event in out if event["type"] == "error")


def test_connections_piling_up_in_their_handshake_from_one_address_get_429_and_the_rest_is_served():
    async def main():
        async with secured(SecuritySettings(max_pending_per_address=2)) as server:
            idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]  # never send a request
            await asyncio.sleep(0.1)
            status, body = await raw_http(server, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            for sock in idle:
                sock.close()
            await asyncio.sleep(0.1)
            async with connect(url(server)) as websocket:
                await websocket.send(START)
                ready = json.loads(await websocket.recv())
            return status, body, ready, dict(server.gate.addresses.pending)

    status, body, ready, pending = run(main())
    assert status == 429 and b"still in their handshake" in body
    assert ready["type"] == "ready" and pending == {}


def test_open_connections_per_address_over_the_limit_get_429():
    async def main():
        async with secured(SecuritySettings(max_connections_per_address=1)) as server:
            async with connect(url(server)) as first:
                await first.send(START)
                await first.recv()
                refused = await refused_status(server)
                open_while = dict(server.gate.addresses.open)
            await asyncio.sleep(0.1)
            async with connect(url(server)) as again:
                await again.send(START)
                ready = json.loads(await again.recv())
            return refused, open_while, ready

    refused, open_while, ready = run(main())
    assert refused[0] == 429 and open_while == {"127.0.0.1": 1} and ready["type"] == "ready"
