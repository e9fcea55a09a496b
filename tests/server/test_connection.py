"""What StreamConnection offers any wire adapter, over real sockets with a fake engine: replies and notices before
the stream starts (and the start timeout), replies in order with the stream's events, the close() hook, finals for
adapters that finalise on disconnect, multichannel streams (natively too: a stereo file with different speech on
each channel) and flushes of one channel.

The scripted adapter turns each text message, a JSON list of steps, into commands: ["start"], ["start", {settings}],
["speech", seconds], ["reply", "text"], ["notice"], ["flush"], ["flush", channel], ["end"]. It encodes events as
the native protocol does and keeps every event it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from qasr.server import app
from qasr.server.commands import Audio, End, Flush, Notice, Reply, Start
from qasr.server.errors import ProtocolError, UnsupportedFormat
from qasr.server.protocol import event_to_dict
from qasr.streaming import events
from qasr.streaming.settings import StreamSettings, VadSettings

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine, speech_like, to_s16le, voiced_burst
from live_server import serving

SCRIPTED_PATH = "/v1/scripted"
SETTINGS = StreamSettings(partials=False, vad=VadSettings(pre_roll_ms=0))
TOLERANCE_S = 0.1


class Unauthorized(ProtocolError):
    http_status = 401


class ScriptedAdapter:
    def __init__(self, *, finalise_on_disconnect: bool = False):
        self.finalise_on_disconnect = finalise_on_disconnect
        self.events: list = []  # every event encode() was given
        self.closed = 0  # close() calls

    def greeting(self) -> list[str]:
        return ["hello"]

    def receive(self, message):
        commands = []
        for step, *arguments in json.loads(message):
            if step == "start":
                commands.append(Start(dataclasses.replace(SETTINGS, **(arguments[0] if arguments else {}))))
            elif step == "speech":
                commands.append(Audio(voiced_burst(arguments[0])[:, None]))
            elif step == "reply":
                commands.append(Reply([arguments[0]]))
            elif step == "notice":
                commands.append(Notice("unknown_field", "a notice"))
            elif step == "flush":
                commands.append(Flush(*arguments))
            elif step == "end":
                commands.append(End())
        return commands

    def encode(self, event) -> list[str]:
        self.events.append(event)
        return [json.dumps(event_to_dict(event))]

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def adapters(monkeypatch) -> list[ScriptedAdapter]:
    """The scripted adapters the server built, in order; `adapters.finalising = True` for the next ones."""
    built: list[ScriptedAdapter] = []

    class Built(list):
        finalising = False

    built = Built()

    def make(handshake) -> ScriptedAdapter:
        refusal = parse_qs(urlsplit(handshake.request.path).query).get("refuse")
        if refusal == ["unauthorized"]:
            raise Unauthorized("the platform's own credential is wrong")
        if refusal:
            raise UnsupportedFormat(f"cannot serve {refusal[0]}")
        built.append(ScriptedAdapter(finalise_on_disconnect=built.finalising))
        return built[-1]

    monkeypatch.setitem(app.WIRE_ADAPTERS, SCRIPTED_PATH, make)
    return built


def run(coroutine, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def url(server, path: str = SCRIPTED_PATH) -> str:
    return f"ws://127.0.0.1:{server.port}{path}"


async def until(condition, timeout: float = 5.0) -> None:
    """Wait (letting the server run in this loop) until `condition()` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"condition not met within {timeout} s"
        await asyncio.sleep(0.01)


def kind(frame: str) -> str:
    try:
        return json.loads(frame)["type"]
    except ValueError:
        return frame  # a reply's text


async def read_all(websocket) -> list[str]:
    frames = []
    with contextlib.suppress(ConnectionClosed):
        async for frame in websocket:
            frames.append(frame)
    return frames


def test_an_adapter_that_cannot_serve_the_handshake_refuses_the_upgrade(adapters):
    async def main():
        async with serving(FakeEngine()) as server:
            statuses = []
            for refusal in ("flac", "unauthorized"):
                with pytest.raises(InvalidStatus) as caught:
                    async with connect(url(server) + f"?refuse={refusal}"):
                        pass
                response = caught.value.response
                statuses.append((response.status_code, response.body.decode().strip()))
            async with connect(url(server)) as websocket:  # the server goes on
                assert await websocket.recv() == "hello"
            return statuses

    assert run(main()) == [(400, "cannot serve flac"), (401, "the platform's own credential is wrong")]
    assert len(adapters) == 1  # only the accepted connection has an adapter


def test_replies_and_notices_before_the_start_go_out_at_once_and_the_start_timeout_still_applies(adapters):
    async def main():
        async with serving(FakeEngine(), start_timeout_s=0.5) as server:
            async with connect(url(server)) as websocket:
                assert await websocket.recv() == "hello"  # the greeting, before the client says anything
                await websocket.send('[["reply", "session.updated"], ["notice"]]')
                assert await websocket.recv() == "session.updated"
                assert json.loads(await websocket.recv())["code"] == "unknown_field"
                await websocket.send('[["start"], ["end"]]')
                assert [kind(frame) for frame in await read_all(websocket)] == ["ready", "summary"]
                assert websocket.close_code == 1000
            async with connect(url(server)) as websocket:  # replies alone never start the stream
                await websocket.send('[["reply", "session.updated"]]')
                frames = await read_all(websocket)
                assert frames[:2] == ["hello", "session.updated"]
                assert json.loads(frames[-1])["code"] == "idle_timeout"
                assert websocket.close_code == 1008
            async with connect(url(server)) as websocket:  # audio before a Start is the adapter's client's mistake
                await websocket.send('[["speech", 0.1]]')
                await read_all(websocket)
                assert websocket.close_code == 1007

    run(main())


def test_replies_are_sent_in_order_with_the_events_made_before_them(adapters):
    async def main():
        async with serving(FakeEngine(delay_s=0.01)) as server:
            async with connect(url(server)) as websocket:
                await websocket.send('[["start"], ["speech", 1.0], ["reply", "after speech"], ["flush"], '
                                     '["reply", "after flush"], ["end"]]')
                frames = [kind(frame) for frame in await read_all(websocket)]
        assert frames == ["hello", "ready", "speech_started", "after speech", "speech_ended", "after flush",
                          "final", "summary"]

    run(main())


def test_close_is_called_once_however_the_connection_ends(adapters):
    async def main():
        async with serving(FakeEngine(), max_sessions=1) as server:
            async with connect(url(server)) as websocket:  # ends normally
                await websocket.send('[["start"], ["end"]]')
                await read_all(websocket)
            async with connect(url(server)) as first:  # the client vanishes mid-stream
                await first.send('[["start"], ["speech", 0.5]]')
                await first.recv()
                async with connect(url(server)) as second:  # refused: the server is full
                    await read_all(second)
                    assert second.close_code == 1013
            await until(lambda: len(adapters) == 3 and all(adapter.closed for adapter in adapters))
        assert [adapter.closed for adapter in adapters] == [1, 1, 1]

    run(main())


@pytest.mark.parametrize("finalising", [True, False])
def test_a_client_that_disconnects_has_its_open_segments_finalised_only_when_the_adapter_asks(adapters, finalising):
    adapters.finalising = finalising

    async def main():
        async with serving(FakeEngine(delay_s=0.02)) as server:
            async with connect(url(server)) as websocket:
                await websocket.send('[["start"], ["speech", 1.0], ["flush"], ["speech", 0.6]]')
                while kind(await websocket.recv()) != "speech_started":
                    pass
            await until(lambda: adapters[0].closed)  # a hang-up without `end`: the finals, if any, come first
        return adapters[0].events

    encoded = run(main())
    finals = [event for event in encoded if isinstance(event, events.Final)]
    if finalising:  # both segments: the flushed one and the one open at the hang-up, then the summary
        assert [(final.segment_id, final.reason) for final in finals] == [(0, "flush"), (1, "end")]
        assert isinstance(encoded[-1], events.Summary) and encoded[-1].segments == 2
    else:
        assert not any(isinstance(event, events.Summary) for event in encoded)
        assert [final.reason for final in finals] in ([], ["flush"])  # only what was done before the hang-up


def test_a_client_that_leaves_while_its_finals_are_due_stops_its_engine_work(adapters):
    """After `end` nothing reads the client's socket; a client that gives up waiting for its finals and closes
    must not leave its segment queued in the engine (decoded for no one) nor its session open until then."""
    engine = FakeEngine(manual=True)

    async def main():
        async with serving(engine) as server:
            async with connect(url(server)) as websocket:
                await websocket.send('[["start"], ["speech", 1.0], ["end"]]')
                await engine.wait_for_calls(1)  # its final, which the engine never finishes
            await until(lambda: adapters[0].closed)
            return server.metrics.sessions_active

    assert run(main(), timeout=10) == 0
    assert [call.request for call in engine.calls] == engine.cancelled  # its final is cancelled, not decoded


def test_a_flush_of_a_channel_the_stream_does_not_have_closes_with_1007(adapters):
    async def main():
        async with serving(FakeEngine()) as server:
            async with connect(url(server)) as websocket:
                await websocket.send('[["start", {"channels": 2, "multichannel": true}], ["flush", 2]]')
                frames = await read_all(websocket)
                assert "channel 2" in json.loads(frames[-1])["message"] and websocket.close_code == 1007
            async with connect(url(server)) as websocket:  # a mono stream's only channel is 0
                await websocket.send('[["start"], ["flush", 0], ["end"]]')
                await read_all(websocket)
                assert websocket.close_code == 1000

    run(main())


def stereo_speech() -> tuple[np.ndarray, list[list[tuple[float, float]]]]:
    """Different speech on each channel: two short turns on the left, one long overlapping turn on the right."""
    left, left_truth = speech_like([("silence", 0.4), ("speech", 1.0), ("silence", 0.9), ("speech", 0.6),
                                    ("silence", 1.1)], seed=1)
    right, right_truth = speech_like([("silence", 0.9), ("speech", 1.8), ("silence", 1.3)], seed=2)
    return np.stack([left, right], axis=1), [left_truth, right_truth]


def test_a_native_multichannel_stream_is_transcribed_per_channel():
    audio, truth = stereo_speech()
    data = to_s16le(audio)  # interleaved frames

    async def main():
        async with serving(FakeEngine(delay_s=0.005)) as server:
            async with connect(url(server, "/v1/stream")) as websocket:
                await websocket.send(json.dumps({"type": "start", "channels": 2, "multichannel": True,
                                                 "partial_interval_ms": 500, "vad": {"pre_roll_ms": 0}}))
                for offset in range(0, len(data), 6400):  # 100 ms of stereo s16le, 5x real time: room for
                    await websocket.send(data[offset:offset + 6400])  # partials
                    await asyncio.sleep(0.02)
                await websocket.send('{"type": "end"}')
                out = [json.loads(frame) for frame in await read_all(websocket)]
                return out, websocket.close_code

    out, close_code = run(main())
    assert close_code == 1000
    assert out[0]["type"] == "ready" and out[0]["config"]["multichannel"] is True and "channel" not in out[0]
    assert out[-1]["type"] == "summary" and "channel" not in out[-1]
    for channel in (0, 1):
        finals = [event for event in out if event["type"] == "final" and event["channel"] == channel]
        started = [event for event in out if event["type"] == "speech_started" and event["channel"] == channel]
        assert [event["segment_id"] for event in started] == [event["segment_id"] for event in finals] \
            == list(range(len(truth[channel])))
        for final, (start, end) in zip(finals, truth[channel]):
            assert abs(final["start"] - start) < TOLERANCE_S and abs(final["end"] - end) < TOLERANCE_S
            assert final["text"] == f"{final['end'] - final['start']:.2f}s"  # this channel's audio only
        assert any(event["type"] == "partial" and event["channel"] == channel for event in out)
    assert out[-1]["segments"] == 3 and out[-1]["audio_seconds"] == pytest.approx(len(audio) / 16000, abs=1e-3)


def test_a_native_flush_of_one_channel():
    audio, _ = stereo_speech()
    data = to_s16le(audio[:int(1.5 * 16000)])  # both channels are speaking at 1.5 s

    async def main():
        async with serving(FakeEngine()) as server:
            async with connect(url(server, "/v1/stream")) as websocket:
                await websocket.send(json.dumps({"type": "start", "channels": 2, "multichannel": True,
                                                 "partials": False}))
                await websocket.send(data)
                await websocket.send('{"type": "flush", "channel": 1}')
                await websocket.send('{"type": "end"}')
                return [json.loads(frame) for frame in await read_all(websocket)]

    finals = [(event["channel"], event["reason"]) for event in run(main()) if event["type"] == "final"]
    assert finals == [(1, "flush"), (0, "end")]
