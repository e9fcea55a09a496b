"""GET /v1/calls/{id}/events over a real socket (the fake engine; calls published straight into the registry): the
path, the close codes, and what a subscriber gets when."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from fakes import FakeEngine
from qasr.server.app import QasrServer, ServerConfig
from qasr.server.call_events import CALL_EVENTS_PATH, WebSocketPaths, call_id_of
from qasr.server.calls import CallOptions, Track
from qasr.server.limits import ServerLimits
from qasr.server.webhooks import WebhookOptions
from qasr.streaming import events

TRACKS = (Track(0, "inbound", "caller"), Track(1, "outbound", "agent"))


def run(coroutine, timeout: float = 20):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


@pytest.mark.parametrize("path, call_id", [
    ("/v1/calls/CA42/events", "CA42"), ("/v1/calls/v3%3Aabc%2Fdef/events?x=1", "v3:abc/def"),
    ("/v1/calls//events", None), ("/v1/calls/CA42", None), ("/v1/calls/a/b/events", None),
    (f"/v1/calls/{'x' * 257}/events", None), ("/v1/stream", None),
])
def test_the_call_id_comes_percent_decoded_from_the_path(path, call_id):
    assert call_id_of(path) == call_id


def test_websocket_paths_are_the_stream_paths_and_every_subscriber_path():
    paths = WebSocketPaths({"/v1/stream", "/v1/twilio"})
    assert "/v1/twilio" in paths and "/v1/calls/x/events" in paths
    assert "/v1/other" not in paths and None not in paths
    assert set(paths) == {"/v1/stream", "/v1/twilio", CALL_EVENTS_PATH} and len(paths) == 3


@contextlib.asynccontextmanager
async def server_with(calls: CallOptions = CallOptions(), webhooks: WebhookOptions | None = None, **limits):
    server = QasrServer(FakeEngine(), ServerConfig(port=0, ping_interval_s=None, calls=calls, webhooks=webhooks,
                                                   limits=ServerLimits(**limits)))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def follow(server: QasrServer, call_id: str) -> tuple[list[dict], int | None]:
    messages = []
    async with connect(f"ws://127.0.0.1:{server.port}/v1/calls/{call_id}/events") as websocket:
        with contextlib.suppress(ConnectionClosed):
            async for frame in websocket:
                messages.append(json.loads(frame))
    return messages, websocket.close_code


async def until(condition, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")


def test_a_subscriber_before_the_call_gets_it_live_and_a_late_one_gets_the_replay_without_partials():
    async def main():
        async with server_with() as server:
            early = asyncio.create_task(follow(server, "CA1"))
            await until(lambda: len(server.subscribers) == 1)
            stream = server.calls.open("CA1", platform="twilio", stream_id="MZ1", tracks=TRACKS)
            stream.event(events.Partial(0, "hel", "English", 0.5, 1.0), 1)
            stream.event(events.Final(0, "hello", "English", 0.5, 1.2, "silence", 30.0), 1)
            stream.dtmf("5", 2.0)
            stream.close("stop")
            live, live_code = await early
            late, late_code = await follow(server, "CA1")
            return live, live_code, late, late_code

    live, live_code, late, late_code = run(main())
    assert [message["type"] for message in live] == ["call_started", "partial", "final", "dtmf", "call_ended"]
    assert live[2]["speaker"] == "agent" and live[2]["text"] == "hello" and live[3]["speaker"] == "caller"
    assert live_code == late_code == 1000
    assert late == [message for message in live if message["type"] != "partial"]


def test_no_room_for_another_awaited_call_is_1013():
    async def main():
        async with server_with(CallOptions(max_calls=1)) as server:
            waiting = asyncio.create_task(follow(server, "first"))
            await until(lambda: len(server.subscribers) == 1)
            refused = await follow(server, "second")
            waiting.cancel()
            return refused

    assert run(main()) == ([], 1013)


def test_shutdown_closes_a_waiting_subscriber_1001_and_lets_a_live_call_end_first():
    async def main():
        async with server_with(drain_timeout_s=5.0) as server:
            waiting = asyncio.create_task(follow(server, "never"))
            live = asyncio.create_task(follow(server, "CA2"))
            await until(lambda: len(server.subscribers) == 2)
            stream = server.calls.open("CA2", platform="twilio", stream_id="MZ2", tracks=TRACKS)
            stopping = asyncio.create_task(server.stop())
            waiting_result = await waiting  # at once: its call is not live
            await asyncio.sleep(0.2)
            assert not live.done()  # a live call keeps its subscriber for its last finals
            stream.event(events.Final(0, "bye", "English", 0.1, 0.9, "end", 10.0), 0)
            stream.close("stop")
            live_result = await live
            await stopping
            return waiting_result, live_result

    (waiting_messages, waiting_code), (live_messages, live_code) = run(main())
    assert (waiting_messages, waiting_code) == ([], 1001)
    assert [message["type"] for message in live_messages] == ["call_started", "final", "call_ended"]
    assert live_code == 1000


def test_a_subscriber_that_falls_behind_is_dropped_with_1008():
    async def main():
        async with server_with(CallOptions(subscriber_queue=3)) as server:
            subscriber = asyncio.create_task(follow(server, "CA3"))
            await until(lambda: len(server.subscribers) == 1)
            stream = server.calls.open("CA3", platform="twilio", stream_id="MZ3", tracks=TRACKS)
            for digit in "0123456789":  # in one go: the sender cannot keep up
                stream.dtmf(digit, 1.0)
            return await subscriber

    messages, code = run(main())
    assert code == 1008 and len(messages) <= 3


def test_a_plain_http_get_of_a_subscriber_path_is_told_to_upgrade():
    async def main():
        async with server_with() as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /v1/calls/CA4/events HTTP/1.1\r\nHost: x\r\n\r\n")
            status = await reader.readline()
            writer.close()
            return status

    assert b" 426 " in run(main())


def test_an_undeliverable_webhook_is_counted_on_the_servers_metrics():
    with socket.socket() as probe:  # a port nobody listens on: connection refused
        probe.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{probe.getsockname()[1]}/hooks"

    async def main():
        options = WebhookOptions(secret=b"s", max_attempts=1, timeout_s=2.0)
        async with server_with(CallOptions(webhook_url=dead_url), options) as server:
            stream = server.calls.open("CA5", platform="twilio", stream_id="MZ5", tracks=TRACKS)
            stream.close("stop")  # call_started and call_ended: two messages for the webhook
        return server.metrics.value("qasr_webhooks_undelivered_total", reason="unreachable")

    assert run(main()) == 2
