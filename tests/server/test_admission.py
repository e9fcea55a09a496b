"""Admission control: with a fake engine (in a pool, as qasr-server runs it) whose finals' latency the test raises,
new streams are refused (HTTP 503 + Retry-After at the handshake; 1013 server_full with a retry hint on a socket
already upgraded, in each wire protocol's own style) once the signal crosses the target, admitted again after it
recovers, with hysteresis; streams already admitted are not cut; partials thin out only once the admitted streams
keep the engine past its target (refusing comes first); /metrics shows the headroom and the refusals; the warm-up
reaches every engine of a pool."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from qasr.engine.pool import EnginePool, LoadPolicy
from qasr.engine.request import DecodeRequest
from qasr.server.admission import Admission, AdmissionSettings
from qasr.server.app import WARM_UP_STREAM, QasrServer, ServerConfig

from fakes import FAKE_TIMINGS_MS, FakeEngine, speech_like, to_s16le

TARGET_MS = 100.0
WINDOW_S = 0.5  # short, so that recovery comes quickly
START = json.dumps({"type": "start"})


class LoadedFake(FakeEngine):
    """A fake engine whose finals report the latency the test sets (`latency_ms`, all of it decoding behind a short
    queue, as on the H200 under load) and the queue delay it sets."""

    def __init__(self, **options):
        super().__init__(**options)
        self.latency_ms = sum(FAKE_TIMINGS_MS.values())
        self.queue_ms = 0.0

    def result_for(self, request, text=None):
        result = FakeEngine.result_for(request, text)
        timings = {"queue_ms": self.queue_ms, "encode_ms": 0.0, "prefill_ms": 0.0,
                   "decode_ms": self.latency_ms - self.queue_ms}
        return dataclasses.replace(result, timings=timings)


def run(coroutine, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


@contextlib.asynccontextmanager
async def serving(*engines: FakeEngine, admission: AdmissionSettings = AdmissionSettings()):
    pool = EnginePool(list(engines), LoadPolicy(target_ms=TARGET_MS, window_s=WINDOW_S))
    server = QasrServer(pool, ServerConfig(port=0, ping_interval_s=None, admission=admission))
    await server.start()
    try:
        yield server, pool
    finally:
        await server.stop()


async def load_with_finals(pool: EnginePool, engine: LoadedFake, latency_ms: float, count: int = 5) -> None:
    """Finals answered with this latency (a short queue, then slow decoding): what the pool measures."""
    engine.latency_ms, engine.queue_ms = latency_ms, min(10.0, latency_ms)
    audio = np.zeros(16000, np.float32)
    for i in range(count):
        await pool.transcribe(DecodeRequest(audio=audio, stream_id=f"load-{latency_ms}-{i}"))
        pool.release_stream(f"load-{latency_ms}-{i}")


async def receive_all(websocket) -> list:
    out = []
    with contextlib.suppress(ConnectionClosed):
        async for message in websocket:
            out.append(json.loads(message) if isinstance(message, str) else message)
    return out


def url(server: QasrServer, path: str = "/v1/stream") -> str:
    return f"ws://127.0.0.1:{server.port}{path}"


# -- the decision ------------------------------------------------------------------------------------------------

def test_refusing_starts_at_no_headroom_and_stops_only_once_it_is_back_above_the_resume_level():
    admission = Admission(AdmissionSettings(resume_headroom=0.2))
    assert admission.admits({"headroom": 0.05})
    assert not admission.admits({"headroom": 0.0})
    assert not admission.admits({"headroom": 0.1})  # recovered a little: still refusing (no flapping at the edge)
    assert not admission.admits({"headroom": 0.19})
    assert admission.admits({"headroom": 0.2})
    assert admission.admits({"headroom": 0.1})  # admitting again until it is 0 once more
    assert not admission.admits({"headroom": -3.0})


def test_off_or_without_a_signal_every_stream_is_admitted():
    assert Admission(AdmissionSettings(enabled=False)).admits({"headroom": -5.0})
    assert Admission().admits({"running": 3})  # an engine that is not a pool reports no headroom
    with pytest.raises(ValueError, match="resume_headroom"):
        AdmissionSettings(resume_headroom=0)
    with pytest.raises(ValueError, match="retry_after_s"):
        AdmissionSettings(retry_after_s=0)


# -- a live server -----------------------------------------------------------------------------------------------

def test_new_streams_are_refused_past_the_target_and_admitted_after_it_recovers_without_cutting_admitted_ones():
    audio, _ = speech_like([("silence", 0.3), ("speech", 0.8), ("silence", 0.8)])
    engine = LoadedFake(delay_s=0.005)

    async def main():
        async with serving(engine) as (server, pool):
            admitted = await connect(url(server))  # before the load
            await admitted.send(START)
            await admitted.recv()  # ready
            await load_with_finals(pool, engine, latency_ms=3 * TARGET_MS)  # 300 ms finals, 10 ms of it queued
            with pytest.raises(InvalidStatus) as refused:
                await connect(url(server))
            response = refused.value.response
            assert response.status_code == 503 and response.headers["Retry-After"] == "2"
            assert b"latency target" in response.body and b"retry after 2 s" in response.body
            page = server.metrics.render(server.engine)
            assert "qasr_admission_headroom -2.0" in page
            assert server.metrics.value("qasr_streams_refused_total", reason="headroom") == 1

            receiving = asyncio.ensure_future(receive_all(admitted))  # the admitted stream goes on to its end
            data = to_s16le(audio)
            for offset in range(0, len(data), 3200):
                await admitted.send(data[offset:offset + 3200])
            await admitted.send('{"type": "end"}')
            events = await receiving
            assert admitted.close_code == 1000
            assert [e["type"] for e in events if e["type"] in ("final", "summary")] == ["final", "summary"]

            await load_with_finals(pool, engine, latency_ms=0.9 * TARGET_MS)  # headroom 0.1: not enough to resume
            with pytest.raises(InvalidStatus):
                await connect(url(server))
            await asyncio.sleep(WINDOW_S + 0.1)  # the slow finals leave the window; quiet since
            async with connect(url(server)) as again:
                await again.send(START)
                assert json.loads(await again.recv())["type"] == "ready"
            return server.metrics.value("qasr_streams_refused_total", reason="headroom")

    assert run(main()) == 2


@pytest.mark.parametrize("path, first, error_of", [
    ("/v1/stream", START, lambda frame: (frame["type"], frame["code"], frame["message"])),
    ("/v1/listen?encoding=linear16&sample_rate=16000", b"\x00\x00" * 160,
     lambda frame: (frame["type"], frame["variant"], frame["description"])),
], ids=["native", "deepgram"])
def test_a_socket_upgraded_before_the_engines_filled_up_is_closed_with_1013_and_a_retry_hint(path, first, error_of):
    engine = LoadedFake(delay_s=0.005)

    async def main():
        async with serving(engine) as (server, pool):
            decisions = iter([True, False])  # the handshake passed; by the time the stream starts it is refused
            server.admission.admits = lambda stats: next(decisions)
            async with connect(url(server, path)) as websocket:
                receiving = asyncio.ensure_future(receive_all(websocket))
                with contextlib.suppress(ConnectionClosed):
                    await websocket.send(first)
                frames = await receiving
            return frames, websocket.close_code, server.metrics.value("qasr_streams_refused_total", reason="headroom")

    frames, code, refused = run(main())
    assert code == 1013 and refused == 1
    kind, error_code, message = error_of(frames[-1])
    assert kind.lower() == "error" and error_code == "server_full" and message.endswith("retry after 2 s")


def test_partials_thin_out_only_once_the_admitted_streams_keep_the_engine_past_its_target():
    audio, _ = speech_like([("silence", 0.3), ("speech", 3.0), ("silence", 0.8)])
    engine = LoadedFake()
    start = json.dumps({"type": "start", "partial_interval_ms": 200})

    async def partials_of_one_stream(server, loaded=None) -> int:
        """One stream's partials; `loaded()` starts the load once the stream is admitted."""
        async with connect(url(server)) as websocket:
            await websocket.send(start)
            assert json.loads(await websocket.recv())["type"] == "ready"
            if loaded is not None:
                await loaded()
            receiving = asyncio.ensure_future(receive_all(websocket))
            data = to_s16le(audio)
            for offset in range(0, len(data), 1600):  # 50 ms pieces, 5x real time: each partial is answered
                await websocket.send(data[offset:offset + 1600])
                await asyncio.sleep(0.01)
            await websocket.send('{"type": "end"}')
            events = await receiving
        assert [e["type"] for e in events if e["type"] in ("final", "summary")] == ["final", "summary"]
        return sum(e["type"] == "partial" for e in events)

    async def main():
        async with serving(engine) as (server, pool):
            at_ease = await partials_of_one_stream(server)
            loading = None

            async def other_streams_finals(latency_ms):
                while True:
                    await load_with_finals(pool, engine, latency_ms=latency_ms, count=2)
                    await asyncio.sleep(0.05)

            async def load(latency_ms):
                nonlocal loading
                loading = asyncio.ensure_future(other_streams_finals(latency_ms))
                await asyncio.sleep(0.1)

            try:  # at the target (headroom 0): new streams are refused, the admitted one keeps its cadence
                at_target = await partials_of_one_stream(server, lambda: load(TARGET_MS))
                thinned_at_target = pool.stats()["partials_thinned"]
                with pytest.raises(InvalidStatus):
                    await connect(url(server))
            finally:
                loading.cancel()
            await asyncio.sleep(WINDOW_S + 0.1)  # recovered: admitting again
            try:  # 30% past it (headroom -0.3): refusing did not hold it, the admitted stream's partials pass 1 in 2
                past_target = await partials_of_one_stream(server, lambda: load(1.3 * TARGET_MS))
            finally:
                loading.cancel()
            return at_ease, at_target, thinned_at_target, past_target, pool.stats()["partials_thinned"]

    at_ease, at_target, thinned_at_target, past_target, thinned = run(main())
    assert at_ease >= 8 and at_target >= at_ease - 2 and thinned_at_target == 0
    assert past_target <= at_ease // 2 + 1 and thinned >= at_ease // 2 - 1


def test_the_warm_up_reaches_every_engine_of_a_pool():
    engines = [FakeEngine(), FakeEngine()]

    async def main():
        server = QasrServer(None, ServerConfig(port=0, ping_interval_s=None))
        await server.start()
        try:
            await server.load_engine(lambda: EnginePool(engines))
            return server.is_ready()
        finally:
            await server.stop()

    assert run(main())
    assert [len(engine.calls) for engine in engines] == [1, 1]
    assert engines[0].calls[0].request.stream_id == WARM_UP_STREAM
    assert engines[0].released == [WARM_UP_STREAM] and engines[1].released == [f"{WARM_UP_STREAM}/1"]


def test_a_slow_warm_up_does_not_refuse_the_first_clients():
    """Found on the H200: the warm-up decode pays first-use costs (seconds), and counted as a final it left no
    headroom, so every stream of the first few seconds was refused 503."""
    engine = LoadedFake()
    engine.latency_ms = 30 * TARGET_MS

    async def main():
        server = QasrServer(None, ServerConfig(port=0, ping_interval_s=None))
        await server.start()
        try:
            await server.load_engine(lambda: EnginePool([engine], LoadPolicy(target_ms=TARGET_MS, window_s=60)))
            async with connect(url(server)) as first:
                await first.send(START)
                return json.loads(await first.recv())["type"], server.engine.stats()["headroom"]
        finally:
            await server.stop()

    assert run(main()) == ("ready", 1.0)
    assert engine.calls[0].request.stream_id == WARM_UP_STREAM  # the slow final was the warm-up's


def test_metrics_label_each_engine_of_a_pool_and_show_the_headroom():
    from prometheus_client.parser import text_string_to_metric_families

    from qasr.server.metrics import ServerMetrics

    engines = [LoadedFake(), LoadedFake()]
    pool = EnginePool(engines, LoadPolicy(target_ms=TARGET_MS, window_s=60.0), clock=lambda: 0.0)

    async def main():
        await load_with_finals(pool, engines[0], latency_ms=0.5 * TARGET_MS, count=1)  # on engine 0, released
        await pool.transcribe(DecodeRequest(audio=np.zeros(16000, np.float32), stream_id="held"))  # engine 0 again

    run(main())
    page = ServerMetrics().render(pool)
    families = [family.name for family in text_string_to_metric_families(page)]
    assert len(families) == len(set(families))  # one family per name: the engines' stats are labelled, not repeated
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(page) for s in family.samples}
    assert samples[("qasr_engine_streams", (("engine", "0"),))] == 1
    assert samples[("qasr_engine_streams", (("engine", "1"),))] == 0
    assert samples[("qasr_engine_final_latency_ms", (("engine", "0"),))] == 0.5 * TARGET_MS
    assert samples[("qasr_engine_final_queue_ms", (("engine", "0"),))] == 10.0
    assert samples[("qasr_engine_headroom", (("engine", "0"),))] == 0.5
    assert samples[("qasr_engine_headroom", (("engine", "1"),))] == 1.0
    assert samples[("qasr_engine_queue_depth", (("engine", "0"), ("kind", "final")))] == 0
    assert samples[("qasr_admission_headroom", ())] == 1.0  # the best engine's
    assert samples[("qasr_engine_partials_thinned_total", ())] == 0
