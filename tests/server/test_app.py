"""The server over real sockets on 127.0.0.1 (ephemeral ports) with a fake engine: streams, limits, bad input,
vanished clients, HTTP endpoints and the SIGTERM path."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from qasr.server.app import QasrServer, ServerConfig
from qasr.server.limits import ServerLimits
from qasr.streaming.settings import StreamLimits

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine, speech_like, to_s16le
from live_server import serving

TWO_BURSTS = [("silence", 0.4), ("speech", 1.0), ("silence", 0.7), ("speech", 0.8), ("silence", 0.7)]
EXACT = {"vad": {"pre_roll_ms": 0}}  # segments start at the first voiced frame: comparable to the truth


def exposition_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value of a Prometheus text page."""
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def run(coroutine, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def running(engine: FakeEngine | None = None, web_root: Path | None = None, **limits):
    """A started server on a fake engine whose readiness the test sets (a FakeEngine is ready unless told not)."""
    engine = engine if engine is not None else FakeEngine(delay_s=0.005)
    return serving(engine, web_root=web_root, start_engine=False, **limits)


def url(server: QasrServer) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/stream"


def decode(message) -> dict:
    return json.loads(message) if isinstance(message, str) else msgpack.unpackb(message, raw=False)


async def receive_all(websocket) -> list[dict]:
    out = []
    with contextlib.suppress(ConnectionClosed):
        async for message in websocket:
            out.append(decode(message))
    return out


async def stream(server: QasrServer, audio_bytes: bytes, *, start: dict | None = None, chunk: int = 3200,
                 flush_at: int | None = None, pace_s: float = 0.0) -> tuple[list[dict], int]:
    """A well-behaved client: start, audio in pieces (faster than real time, `pace_s` apart), optional flush,
    end."""
    async with connect(url(server)) as websocket:
        await websocket.send(json.dumps({"type": "start", **(start or {})}))
        receiving = asyncio.ensure_future(receive_all(websocket))
        with contextlib.suppress(ConnectionClosed):  # the server may close first (a failed engine): read why
            for offset in range(0, len(audio_bytes), chunk):
                if flush_at is not None and offset == flush_at:
                    await websocket.send('{"type": "flush"}')
                await websocket.send(audio_bytes[offset:offset + chunk])
                await asyncio.sleep(pace_s)
            await websocket.send('{"type": "end"}')
        out = await receiving
        return out, websocket.close_code


async def attempt(server: QasrServer, *messages, wait_s: float = 5.0) -> tuple[list[dict], int]:
    """A misbehaving client: send `messages` as they are, then read until the server closes."""
    async with connect(url(server), max_size=None) as websocket:
        receiving = asyncio.ensure_future(receive_all(websocket))
        for message in messages:
            with contextlib.suppress(ConnectionClosed):
                await websocket.send(message)
        out = await asyncio.wait_for(receiving, wait_s)
        return out, websocket.close_code


async def http_get(server: QasrServer, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, body


async def until(condition, timeout: float = 5.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


def finals(out: list[dict]) -> list[dict]:
    return [event for event in out if event["type"] == "final"]


# ---------------------------------------------------------------------------------------------------------


def test_a_stream_gets_ready_partials_finals_with_true_times_a_summary_and_1000():
    async def main():
        async with running() as server:
            audio, truth = speech_like([("silence", 0.4), ("speech", 2.4), ("silence", 0.7), ("speech", 0.8),
                                        ("silence", 0.7)])
            out, code = await stream(server, to_s16le(audio), start={"partial_interval_ms": 500, **EXACT},
                                     pace_s=0.02)  # 5x real time: partials come back while the segment is open
            return out, code, truth

    out, code, truth = run(main())
    assert code == 1000
    ready = out[0]
    assert ready["type"] == "ready" and ready["model"] == "fake-qwen3-asr" and len(ready["session_id"]) == 16
    assert ready["sample_rate"] == 16000 and ready["engine_sample_rate"] == 16000
    assert ready["limits"]["max_message_bytes"] == 1 << 20 and ready["limits"]["idle_timeout_s"] == 30
    assert ready["config"]["partial_interval_ms"] == 500 and ready["config"]["encoding"] == "s16le"
    assert ready["config"]["vad"] == {"aggressiveness": 2, "end_silence_ms": 500, "pre_roll_ms": 0,
                                      "max_segment_s": 30.0}
    assert [event["segment_id"] for event in finals(out)] == [0, 1]
    for final, (start, end) in zip(finals(out), truth):
        assert abs(final["start"] - start) < 0.1 and abs(final["end"] - end) < 0.1
        assert final["text"] == f"{final['end'] - final['start']:.2f}s" and final["reason"] == "silence"
        assert final["latency_ms"] >= 0
    assert any(event["type"] == "partial" and event["segment_id"] == 0 for event in out)
    types = [event["type"] for event in out]
    assert types.index("speech_started") < types.index("partial") < types.index("final")
    assert out[-1] == {"type": "summary", "segments": 2, "audio_seconds": pytest.approx(5.0),
                       "speech_seconds": pytest.approx(sum(f["end"] - f["start"] for f in finals(out)))}


def test_flush_end_and_the_trailing_segment_at_other_rates_and_in_msgpack():
    async def main():
        async with running() as server:
            audio, _ = speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.2), ("speech", 0.6)],
                                   sample_rate=48000)
            flush_at = 2 * int(1.3 * 48000)  # bytes: right after the first burst
            return await stream(server, to_s16le(audio), chunk=2 * 4800, flush_at=flush_at,
                                start={"sample_rate": 48000, "format": "msgpack", "partials": False, **EXACT})

    out, code = run(main())
    assert code == 1000
    assert [(final["segment_id"], final["reason"]) for final in finals(out)] == [(0, "flush"), (1, "end")]
    assert finals(out)[0]["end"] == pytest.approx(1.3, abs=0.1)
    assert finals(out)[1]["start"] == pytest.approx(1.5, abs=0.1)
    assert out[-1]["type"] == "summary" and out[-1]["audio_seconds"] == pytest.approx(2.1)


def test_two_dozen_concurrent_streams_each_get_their_own_finals():
    async def main():
        async with running(max_sessions=32) as server:
            patterns = [[("silence", 0.3)] + [("speech", 0.5 + 0.1 * (i % 3)), ("silence", 0.9)] * (1 + i % 3)
                        for i in range(24)]
            results = await asyncio.gather(*(
                stream(server, to_s16le(speech_like(pattern, seed=i)[0]), start={"partials": i % 2 == 0, **EXACT})
                for i, pattern in enumerate(patterns)))
            return patterns, results, server

    patterns, results, server = run(main())
    session_ids = set()
    for i, (pattern, (out, code)) in enumerate(zip(patterns, results)):
        bursts = [seconds for kind, seconds in pattern if kind == "speech"]
        assert code == 1000
        session_ids.add(out[0]["session_id"])
        assert [final["segment_id"] for final in finals(out)] == list(range(len(bursts)))
        for final, seconds in zip(finals(out), bursts):
            assert final["end"] - final["start"] == pytest.approx(seconds, abs=0.1)
        assert out[-1]["segments"] == len(bursts)
    assert len(session_ids) == 24
    assert server.metrics.value("qasr_sessions_total") == 24 and server.metrics.sessions_active == 0


START = json.dumps({"type": "start"})
BAD_INPUTS = {
    "audio before start": ([b"\x00\x00"], 1007, "malformed"),
    "invalid JSON": (["{not json"], 1007, "malformed"),
    "unknown type": (['{"type": "pause"}'], 1007, "malformed"),
    "start twice": ([START, START], 1007, "malformed"),
    "partial sample": ([START, b"\x00\x00" * 100 + b"\x00"], 1007, "malformed"),
    "bad value": (['{"type": "start", "partial_interval_ms": "soon"}'], 1007, "malformed"),
    "unsupported rate": (['{"type": "start", "sample_rate": 4000}'], 1003, "unsupported"),
    "unsupported encoding": (['{"type": "start", "encoding": "s24le"}'], 1003, "unsupported"),
    "unsupported channels": (['{"type": "start", "channels": 12}'], 1003, "unsupported"),
    "message too big": ([START, bytes(70_000)], 1009, None),  # websockets closes it; no event fits
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gets_its_close_code_while_another_stream_carries_on(case):
    messages, expected_code, error_code = BAD_INPUTS[case]

    async def main():
        engine = FakeEngine(delay_s=0.005)
        async with running(engine, max_message_bytes=65536) as server:
            audio, _ = speech_like(TWO_BURSTS)
            good = asyncio.ensure_future(stream(server, to_s16le(audio), chunk=800))
            await until(lambda: server.metrics.sessions_active >= 1)
            bad = await attempt(server, *messages)
            return bad, await good, engine

    (bad_out, bad_code), (good_out, good_code), engine = run(main())
    assert bad_code == expected_code
    errors = [event for event in bad_out if event["type"] == "error"]
    if error_code is None:
        assert errors == []
    else:
        assert errors[-1]["code"] == error_code and errors[-1]["fatal"] is True
        assert "Traceback" not in errors[-1]["message"]
    assert good_code == 1000 and len(finals(good_out)) == 2 and good_out[-1]["type"] == "summary"
    assert not engine.streams


def test_a_fatal_error_mid_stream_still_delivers_the_open_segments_final_first():
    async def main():
        async with running() as server:
            audio, _ = speech_like([("silence", 0.3), ("speech", 1.0)])
            return await attempt(server, json.dumps({"type": "start", "partials": False}), to_s16le(audio),
                                 b"\x01")

    out, code = run(main())
    assert code == 1007
    assert [event["type"] for event in out] == ["ready", "speech_started", "error", "final", "summary"]
    assert out[2]["code"] == "malformed" and "whole samples" in out[2]["message"]
    assert out[3]["reason"] == "end"


def test_unknown_fields_get_an_error_event_and_the_stream_carries_on():
    async def main():
        async with running() as server:
            audio, _ = speech_like(TWO_BURSTS)
            return await stream(server, to_s16le(audio), start={"colour": "blue"})

    out, code = run(main())
    assert code == 1000
    assert out[1] == {"type": "error", "code": "unknown_field", "message": "start: ignored unknown field(s) colour",
                      "fatal": False}
    assert len(finals(out)) == 2


def test_an_unknown_field_in_end_gets_its_error_event_before_the_finals():
    async def main():
        async with running() as server:
            audio, _ = speech_like([("silence", 0.3), ("speech", 1.0)])
            return await attempt(server, json.dumps({"type": "start", "partials": False}), to_s16le(audio),
                                 '{"type": "end", "why": "done"}')

    out, code = run(main())
    assert code == 1000
    assert [event["type"] for event in out] == ["ready", "speech_started", "error", "final", "summary"]
    assert out[2] == {"type": "error", "code": "unknown_field", "message": "end: ignored unknown field(s) why",
                      "fatal": False}


def test_an_idle_client_is_closed_with_1008_after_its_finals():
    async def main():
        async with running(idle_timeout_s=0.3) as server:
            audio, _ = speech_like([("silence", 0.3), ("speech", 0.8)])
            idle_before_start = await attempt(server)
            idle_mid_speech = await attempt(server, json.dumps({"type": "start", "partials": False}), to_s16le(audio))
            return idle_before_start, idle_mid_speech

    (before_out, before_code), (mid_out, mid_code) = run(main())
    assert before_code == 1008 and before_out[0]["code"] == "idle_timeout"
    assert mid_code == 1008
    assert [event["type"] for event in mid_out] == ["ready", "speech_started", "error", "final", "summary"]


def test_a_client_sending_more_often_than_the_idle_timeout_is_never_idle():
    async def main():
        async with running(idle_timeout_s=0.3) as server:
            silence = to_s16le(np.zeros(1600, np.float32))
            # 1.2 s in all, 0.1 s apart: four idle timeouts long, never 0.3 s quiet
            return await stream(server, silence * 12, start={"partials": False}, chunk=len(silence), pace_s=0.1)

    out, code = run(main())
    assert code == 1000 and out[-1]["type"] == "summary" and not [e for e in out if e["type"] == "error"]


def test_websocket_pings_count_as_activity_for_the_idle_timeout():
    """A push-to-talk client stays connected between presses by pinging (issue #14 item 5)."""
    async def main():
        async with running(idle_timeout_s=0.3) as server:
            async with connect(url(server), ping_interval=None) as websocket:
                await websocket.send(json.dumps({"type": "start", "partials": False}))
                for _ in range(10):  # 1 s: three idle timeouts long, never 0.3 s without a ping
                    await asyncio.sleep(0.1)
                    await websocket.ping()
                await websocket.send('{"type": "end"}')
                return await receive_all(websocket), websocket.close_code

    out, code = run(main())
    assert code == 1000 and [event["type"] for event in out] == ["ready", "summary"]


def test_a_full_server_closes_with_1013_and_a_loading_one_refuses_the_upgrade_with_503():
    async def main():
        engine = FakeEngine(delay_s=0.005)
        async with running(engine, max_sessions=2) as server:
            holders = [await connect(url(server)) for _ in range(2)]
            for holder in holders:
                await holder.send(START)
                await holder.recv()  # ready
            full = await attempt(server, START)
            for holder in holders:
                await holder.close()
            engine.ready = False
            await until(lambda: server.metrics.sessions_active == 0)
            with pytest.raises(InvalidStatus) as refused:
                await connect(url(server))
            return full, refused.value.response

    (full_out, full_code), not_ready = run(main())
    assert full_code == 1013 and full_out == [{"type": "error", "code": "server_full", "fatal": True,
                                               "message": full_out[0]["message"]}]
    # before the upgrade: a load balancer (nginx's proxy_next_upstream http_503) retries it on another replica
    assert not_ready.status_code == 503 and not_ready.headers["Retry-After"] == "1"
    assert b"still loading" in not_ready.body


def test_a_vanished_client_leaves_no_tasks_sessions_or_engine_streams():
    async def main():
        engine = FakeEngine(manual=True)
        async with running(engine) as server:
            await asyncio.sleep(0.05)
            baseline = asyncio.all_tasks()
            audio, _ = speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.7), ("speech", 2.0)])
            websocket = await connect(url(server))
            await websocket.send(json.dumps({"type": "start", "partial_interval_ms": 500}))
            await websocket.send(to_s16le(audio))
            await until(lambda: len(engine.pending()) >= 2)  # a final and a partial in the engine
            websocket.transport.abort()  # gone mid-sentence, without a closing handshake
            await until(lambda: server.metrics.sessions_active == 0)
            await until(lambda: not asyncio.all_tasks() - baseline - {asyncio.current_task()})  # but until's own
            return engine, server

    engine, server = run(main())
    assert not engine.waiting and not engine.streams
    assert {request.priority.name for request in engine.cancelled} == {"FINAL", "PARTIAL"}
    assert not server.connections


def test_healthz_readyz_metrics_and_the_web_page(tmp_path):
    (tmp_path / "index.html").write_text("<h1>qasr</h1>")
    (tmp_path / "app.js").write_text("console.log(1)")

    async def main():
        engine = FakeEngine(delay_s=0.005, ready=False)
        async with running(engine, web_root=tmp_path) as server:
            replies = {"healthz": await http_get(server, "/healthz"), "not ready": await http_get(server, "/readyz")}
            engine.ready = True
            replies["ready"] = await http_get(server, "/readyz")
            audio, _ = speech_like(TWO_BURSTS)
            await stream(server, to_s16le(audio), start={"partial_interval_ms": 500})
            await attempt(server, "oops")
            for path in ("/metrics", "/", "/app.js", "/../secret", "/nope.html", "/v1/stream"):
                replies[path] = await http_get(server, path)
            return replies

    replies = run(main())
    assert replies["healthz"][0] == 200
    assert replies["not ready"][0] == 503 and replies["ready"][0] == 200
    status, headers, body = replies["/metrics"]
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    shown = exposition_samples(text)
    for line in ("qasr_sessions_active 0", "qasr_sessions_total 1", "qasr_connections_total 2", "qasr_finals_total 2", "qasr_segments_total 2",
                 'qasr_errors_total{code="malformed"} 1', 'qasr_closes_total{code="1000"} 1',
                 'qasr_closes_total{code="1007"} 1', "qasr_final_latency_seconds_count 2",
                 'qasr_final_latency_seconds_bucket{le="+Inf"} 2', "qasr_engine_ready 1",
                 'qasr_engine_queue_depth{kind="final"} 0', "qasr_engine_last_batch_sizes_max 2",
                 'qasr_engine_stage_seconds_count{priority="final",stage="queue"} 2',
                 'qasr_engine_stage_seconds_sum{priority="final",stage="decode"} 0.12',
                 'qasr_engine_stage_seconds_bucket{priority="final",stage="decode",le="0.05"} 0',
                 'qasr_engine_stage_seconds_bucket{priority="final",stage="decode",le="0.1"} 2'):
        (key, value), = exposition_samples(line).items()  # the library writes numbers as floats (1.0)
        assert shown.get(key) == value, line
    assert "qasr_partial_latency_seconds_count" in text and "qasr_partials_total" in text
    assert replies["/"][0] == 200 and replies["/"][2] == b"<h1>qasr</h1>"
    assert replies["/"][1]["Content-Type"] == "text/html; charset=utf-8"
    assert replies["/app.js"][0] == 200
    assert replies["/../secret"][0] == 404 and replies["/nope.html"][0] == 404
    assert replies["/v1/stream"][0] == 426  # a plain GET on the WebSocket path


def test_metrics_show_event_loop_lag_and_process_cpu():
    async def main():
        async with running() as server:
            await asyncio.sleep(0.15)  # one timer round with nothing blocking
            quiet = server.metrics.value("qasr_event_loop_lag_seconds_count")
            time.sleep(0.12)  # a handler that blocks the loop delays the watcher's timer by about as much
            await asyncio.sleep(0.15)
            return quiet, (await http_get(server, "/metrics"))[2].decode()

    quiet, text = run(main())
    assert quiet >= 1
    shown = exposition_samples(text)
    lags = {dict(labels)["le"]: value for (name, labels), value in shown.items()
            if name == "qasr_event_loop_lag_seconds_bucket"}
    assert lags["+Inf"] - lags["0.01"] >= 1  # the blocked round: at least ~20 ms late
    assert shown[("process_cpu_seconds_total", frozenset())] > 0


def test_an_engine_whose_slots_cannot_hold_the_longest_segment_is_refused_at_load():
    class ShortEngine(FakeEngine):
        def check_context(self, context, *, language=None, max_audio_seconds):
            raise ValueError("context too long: 0 tokens")

    engine = ShortEngine()

    async def main():
        server = QasrServer(None, ServerConfig(port=0, stream_limits=StreamLimits(max_segment_s=30)))
        with pytest.raises(ValueError, match="cannot hold a 30 s segment.*--max-len"):
            await server.load_engine(lambda: engine)
        return server

    server = run(main())
    assert engine.closed and server.engine is None and not server.is_ready()


def test_audio_frames_are_not_compressed_even_when_a_client_offers_it():
    async def main():
        async with running() as server:
            async with connect(url(server), compression="deflate") as websocket:
                return websocket.response.headers.get("Sec-WebSocket-Extensions")

    assert run(main()) is None


def test_without_a_web_page_slash_says_how_to_get_one():
    async def main():
        async with running() as server:
            return await http_get(server, "/")

    status, _, body = run(main())
    assert status == 404 and b"--web-root" in body


def test_stop_sends_open_streams_their_finals_then_closes_1001_and_the_engine():
    async def main():
        engine = FakeEngine(delay_s=0.02)
        server = QasrServer(engine, ServerConfig(port=0, ping_interval_s=None))
        await server.start()
        audio, _ = speech_like([("silence", 0.3), ("speech", 1.5)])
        websocket = await connect(url(server))
        await websocket.send(json.dumps({"type": "start", "partials": False}))
        await websocket.send(to_s16le(audio))
        received = [decode(await websocket.recv()), decode(await websocket.recv())]  # ready, speech_started
        await server.stop()
        received += await receive_all(websocket)
        with pytest.raises(OSError):
            await connect(url(server), open_timeout=1)
        return received, websocket.close_code, engine, server

    out, code, engine, server = run(main())
    assert code == 1001
    assert [event["type"] for event in out] == ["ready", "speech_started", "error", "final", "summary"]
    assert out[2]["code"] == "going_away" and out[3]["reason"] == "end"
    assert engine.closed and not engine.streams and server.metrics.sessions_active == 0


def test_stop_gives_up_on_finals_after_the_drain_timeout():
    async def main():
        engine = FakeEngine(manual=True)  # never answers
        server = QasrServer(engine, ServerConfig(port=0, ping_interval_s=None,
                                                 limits=ServerLimits(drain_timeout_s=0.2)))
        await server.start()
        audio, _ = speech_like([("silence", 0.3), ("speech", 1.0)])
        websocket = await connect(url(server))
        await websocket.send(json.dumps({"type": "start", "partials": False}))
        await websocket.send(to_s16le(audio))
        await websocket.recv()
        await websocket.recv()
        await server.stop()
        rest = await receive_all(websocket)
        return rest, websocket.close_code, engine

    rest, code, engine = run(main())
    assert code == 1001
    assert [event["type"] for event in rest] == ["error"]  # going_away; the final never came
    assert not engine.streams


def test_an_engine_that_dies_closes_its_streams_with_1011_without_details():
    async def main():
        engine = FakeEngine(delay_s=0.005)
        async with running(engine) as server:
            engine.fail_with = RuntimeError("secret internal detail")
            audio, _ = speech_like(TWO_BURSTS)
            failed_decode = await stream(server, to_s16le(audio), start={"partials": False})
            engine.fail_with = None
            await engine.close()
            engine.ready = True  # still says ready, but every call raises EngineClosed
            closed_engine = await stream(server, to_s16le(audio), start={"partials": False})
            return failed_decode, closed_engine

    (failed_out, failed_code), (closed_out, closed_code) = run(main())
    assert failed_code == 1000  # a failed decode is not fatal: an error event and an empty final
    assert [event["code"] for event in failed_out if event["type"] == "error"] == ["decode_failed"] * 2
    assert [final["text"] for final in finals(failed_out)] == ["", ""]
    assert "secret" not in json.dumps(failed_out)
    assert closed_code == 1011
    assert closed_out[-1] == {"type": "error", "code": "internal", "message": "internal server error",
                              "fatal": True}


def test_a_connection_that_never_starts_gives_its_slot_back_after_the_start_timeout():
    async def main():
        async with running(idle_timeout_s=30, start_timeout_s=0.3, max_sessions=1) as server:
            silent = await attempt(server)  # connects and sends nothing
            ok = await attempt(server, START, json.dumps({"type": "end"}))  # the slot is free again
            return silent, ok

    (silent_out, silent_code), (ok_out, ok_code) = run(main())
    assert silent_code == 1008 and silent_out[0]["code"] == "idle_timeout"
    assert ok_code == 1000 and ok_out[-1]["type"] == "summary"


def test_a_context_the_engine_cannot_fit_is_refused_at_start():
    async def main():
        async with running(FakeEngine()) as server:
            start = json.dumps({"type": "start", "context": "x" * (FakeEngine.MAX_CONTEXT_CHARS + 1)})
            return await attempt(server, start)

    out, code = run(main())
    assert code == 1007 and out[0]["type"] == "error" and "context too long" in out[0]["message"]


def test_healthz_fails_once_the_engine_has_died():
    async def main():
        engine = FakeEngine()
        async with running(engine) as server:
            alive = await http_get(server, "/healthz")
            engine.error = RuntimeError("CUDA error: an illegal memory access was encountered")
            dead = await http_get(server, "/healthz")
            return alive, dead

    (alive_status, _, _), (dead_status, _, dead_body) = run(main())
    assert alive_status == 200
    assert dead_status == 500 and b"engine failed: RuntimeError" in dead_body
