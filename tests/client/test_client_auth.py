"""qasr.client against a server that requires an API key (tests/live_server.py `requiring_key`): the key as
`Authorization: Bearer`, a minted token as the `qasr.token.` subprotocol, no/wrong key and an expired token refused
with AuthenticationFailed (never retried), 429 as TooManyConnections (retryable), reconnects that reuse the key;
and the credential checks and refusal messages without a socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request

import pytest
import soundfile

from qasr.client import (AccessDenied, AuthenticationFailed, Credentials, Final, HandshakeRefused, Ready,
                         Reconnecting, ServerUnreachable, StreamClient, Summary, TooManyConnections, file_source,
                         stream_audio)
from qasr.client.protocol import TOKEN_SUBPROTOCOL
from qasr.server import auth

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine, speech_like
from live_server import requiring_key, serving, stream_url

KEY = "test-key-0123456789abcdef"
WRONG_KEY = "not-the-key-0123456789"
TWO_BURSTS = [("silence", 0.3), ("speech", 1.0), ("silence", 0.8), ("speech", 1.0), ("silence", 0.8)]


def run(coroutine, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def write_wav(path, pattern=TWO_BURSTS):
    audio, truth = speech_like(pattern)
    soundfile.write(str(path), audio, 16000, subtype="PCM_16")
    return truth


def keyed_server(**limits):
    return serving(FakeEngine(delay_s=0.005), security=requiring_key(KEY), **limits)


async def mint_token(port: int, ttl_s: float = 60) -> str:
    """POST /v1/tokens with the key, as a backend would for a browser."""
    def post() -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/tokens?ttl_s={ttl_s:g}", method="POST",
                                         headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)

    return (await asyncio.to_thread(post))["token"]


async def collect(stream) -> list:
    return [event async for event in stream]


# -- against a live server ---------------------------------------------------------------------------------


def test_the_key_goes_as_a_bearer_header_and_the_stream_runs(tmp_path):
    write_wav(tmp_path / "talk.wav")

    async def main():
        async with keyed_server() as server:
            async with StreamClient(stream_url(server.port), api_key=KEY) as client:
                sent = client._websocket.request.headers
                authorization, subprotocol = sent.get("Authorization"), client._websocket.subprotocol
                await client.end()
                [event async for event in client.events()]
            events = await collect(stream_audio(stream_url(server.port), file_source(tmp_path / "talk.wav",
                                                                                     speed=8.0), api_key=KEY))
            return authorization, subprotocol, events

    authorization, subprotocol, events = run(main())
    assert authorization == f"Bearer {KEY}" and subprotocol is None
    assert isinstance(events[0], Ready) and isinstance(events[-1], Summary)
    assert [event.segment_id for event in events if isinstance(event, Final)] == [0, 1]


def test_a_minted_token_goes_as_the_token_subprotocol(tmp_path):
    async def main():
        async with keyed_server() as server:
            token = await mint_token(server.port)
            async with StreamClient(stream_url(server.port), token=token) as client:
                sent = client._websocket.request.headers
                return token, sent.get("Authorization"), sent.get("Sec-WebSocket-Protocol"), \
                    client._websocket.subprotocol, client.ready

    token, authorization, offered, echoed, ready = run(main())
    assert authorization is None and offered == echoed == TOKEN_SUBPROTOCOL + token
    assert ready is not None


@pytest.mark.parametrize("credential, kind, server_says", [
    ({}, None, "an API key is required"),
    ({"api_key": WRONG_KEY}, "api_key", "the API key is not valid"),
    ({"token": "v1.eyJrIjoiY2kiLCJlIjoxfQ.forged"}, "token", "signature is not valid"),
])
def test_no_key_a_wrong_key_or_a_bad_token_is_authentication_failed_and_never_retried(tmp_path, credential, kind,
                                                                                      server_says):
    write_wav(tmp_path / "talk.wav")

    async def main():
        async with keyed_server() as server:
            events = []
            with pytest.raises(AuthenticationFailed) as caught:
                async for event in stream_audio(stream_url(server.port), file_source(tmp_path / "talk.wav"),
                                                reconnect=3, reconnect_delay_s=0.01, **credential):
                    events.append(event)
            return caught.value, events, len(server.connections)

    error, events, open_connections = run(main())
    assert error.status == 401 and error.credential == kind and not error.retryable
    assert server_says in error.message and server_says in str(error)
    assert events == [] and open_connections == 0  # no Reconnecting: a 401 is final
    assert error.__cause__ is None and error.__suppress_context__  # no chained websockets traceback
    assert WRONG_KEY not in str(error) and "v1.eyJ" not in str(error)
    if kind is None:
        assert "requires an API key: pass api_key=" in str(error)


def test_an_expired_token_says_to_mint_a_new_one():
    async def main():
        async with keyed_server() as server:
            token = await mint_token(server.port, ttl_s=1)
            await asyncio.sleep(2.1)  # tokens expire on whole seconds
            with pytest.raises(AuthenticationFailed) as caught:
                await StreamClient(stream_url(server.port), token=token).connect()
            return caught.value

    error = run(main())
    assert error.credential == "token" and "expired" in error.message and "mint a new one" in str(error)


def test_a_key_is_not_needed_where_authentication_is_off_and_is_ignored_there():
    async def main():
        async with serving(FakeEngine()) as server:
            async with StreamClient(stream_url(server.port), api_key=WRONG_KEY) as client:
                return client.ready

    assert run(main()) is not None


def test_too_many_connections_from_one_address_is_retryable():
    async def main():
        security = requiring_key(KEY)
        security = type(security)(auth=security.auth, max_connections_per_address=1)
        async with serving(FakeEngine(), security=security) as server:
            async with StreamClient(stream_url(server.port), api_key=KEY):
                with pytest.raises(TooManyConnections) as caught:
                    await StreamClient(stream_url(server.port), api_key=KEY).connect()
            return caught.value

    error = run(main())
    assert error.status == 429 and error.retryable and "try again later" in str(error)


def test_reconnects_after_a_restart_send_the_key_again(tmp_path):
    write_wav(tmp_path / "talk.wav", [("silence", 0.3)] + [("speech", 1.0), ("silence", 0.8)] * 4)

    async def main():
        async with contextlib.AsyncExitStack() as servers:
            first = await servers.enter_async_context(keyed_server())
            port = first.port
            stream = stream_audio(stream_url(port), file_source(tmp_path / "talk.wav", speed=4.0), reconnect=5,
                                  reconnect_delay_s=0.05, api_key=KEY)
            events, restarted = [], False
            async for event in stream:
                events.append(event)
                if isinstance(event, Final) and event.segment_id == 0 and not restarted:
                    asyncio.ensure_future(first.stop())
                if isinstance(event, Reconnecting) and not restarted:
                    await first.wait_stopped()
                    await servers.enter_async_context(
                        serving(FakeEngine(delay_s=0.005), port=port, security=requiring_key(KEY)))
                    restarted = True
            return events

    events = run(main())
    assert len([event for event in events if isinstance(event, Ready)]) == 2  # the second server took the key
    assert isinstance(events[-1], Summary) and len([e for e in events if isinstance(e, Final)]) >= 3


# -- without a socket --------------------------------------------------------------------------------------


def test_the_token_subprotocol_is_the_servers():
    assert TOKEN_SUBPROTOCOL == auth.TOKEN_SUBPROTOCOL


def test_credentials_are_checked_without_showing_them():
    assert Credentials(api_key=f"  {KEY}\n").headers() == {"Authorization": f"Bearer {KEY}"}
    assert Credentials(token="v1.abc.def").subprotocols() == ["qasr.token.v1.abc.def"]
    assert Credentials().headers() == {} and Credentials().subprotocols() == [] and Credentials().kind is None
    assert KEY not in repr(Credentials(api_key=KEY)) and KEY not in repr(StreamClient("ws://h/v1/stream",
                                                                                      api_key=KEY).credentials)
    with pytest.raises(ValueError, match="not both"):
        Credentials(api_key=KEY, token="v1.a.b")
    with pytest.raises(ValueError, match="non-empty"):
        StreamClient("ws://h/v1/stream", api_key=" ")
    for bad in ({"api_key": "secret\r\nX-Injected: 1"}, {"api_key": "sécret-key-0123456789"},
                {"token": "v1.a b.c"}, {"token": "v1.a,b.c"}):
        with pytest.raises(ValueError, match="characters") as caught:
            Credentials(**bad)
        assert next(iter(bad.values())) not in str(caught.value)
    with pytest.raises(ValueError, match="not both"):
        stream_audio("ws://h/v1/stream", [], api_key=KEY, token="v1.a.b")  # at once, not at the first connect


@pytest.mark.parametrize("status, kind, retryable", [(401, AuthenticationFailed, False), (403, AccessDenied, False),
                                                     (429, TooManyConnections, True)])
def test_refusals_map_to_errors_that_say_what_to_do_and_never_echo_the_key(status, kind, retryable):
    client = StreamClient("ws://h:1/v1/stream", api_key=KEY)
    error = client._refused(status, f"a proxy said: bad {KEY}\nsecond line\n".encode())
    assert isinstance(error, kind) and isinstance(error, HandshakeRefused) and error.retryable is retryable
    assert KEY not in str(error) and error.message == "a proxy said: bad ***" and "second line" not in str(error)
    assert client._refused(404, b"") is None  # not a refusal: the wrong-path ServerUnreachable
    assert not issubclass(kind, ServerUnreachable)
