"""EnginePool over fake engines: new streams go to the least-loaded engine, a stream's requests all go to its engine,
release frees its placement, a failed engine leaves the others serving, headroom follows the finals' latency (the
round trip, never less than the engine's own account: queue + encode + prefill + decode) and the decode rows, and
partials thin only past the target (refusing new streams comes first). (Two real engine processes:
test_pool_processes.py.)
"""

import asyncio
import dataclasses

import numpy as np
import pytest

from qasr.engine.pool import EnginePool, LoadPolicy, RecentDelays
from qasr.engine.request import DecodeRequest, EngineClosed, Priority, Superseded

from fakes import FAKE_TIMINGS_MS, FakeEngine

AUDIO = np.zeros(16000, np.float32)


class LoadedFake(FakeEngine):
    """A fake engine whose finals report the queue delay and the decode time a test sets (its latency under load: the
    encode and prefill take nothing) and, optionally, the decode-row stats a real engine reports."""

    def __init__(self, **options):
        super().__init__(**options)
        self.queue_ms = FAKE_TIMINGS_MS["queue_ms"]
        self.decode_ms = 0.0
        self.rows: dict | None = None  # e.g. {"running": 8, "free_slots": 0, "batch_sizes": [8] * 64}

    def result_for(self, request, text=None):
        result = FakeEngine.result_for(request, text)
        return dataclasses.replace(result, timings=result.timings | {
            "queue_ms": self.queue_ms, "encode_ms": 0.0, "prefill_ms": 0.0, "decode_ms": self.decode_ms})

    def stats(self) -> dict:
        return super().stats() | (self.rows or {})


def request(stream_id, priority=Priority.FINAL):
    return DecodeRequest(audio=AUDIO, stream_id=stream_id, priority=priority)


def test_new_streams_go_to_the_least_loaded_engine_and_stay_there():
    a, b = FakeEngine(), FakeEngine()
    pool = EnginePool([a, b])

    async def main():
        for stream in ("s1", "s2", "s3", "s4"):
            await pool.transcribe(request(stream, Priority.PARTIAL))
        assert [c.request.stream_id for c in a.calls] == ["s1", "s3"]  # alternating: each had fewer streams
        assert [c.request.stream_id for c in b.calls] == ["s2", "s4"]
        for _ in range(3):  # s1's later requests follow it to its engine, though it now has as many streams as b
            await pool.transcribe(request("s1", Priority.PARTIAL))
        await pool.transcribe(request("s1"))
        assert [c.request.stream_id for c in a.calls] == ["s1", "s3", "s1", "s1", "s1", "s1"]
        assert [e["streams"] for e in pool.stats()["engines"]] == [2, 2]

    asyncio.run(main())


def test_release_frees_the_placement_and_reaches_only_the_streams_engine():
    a, b = FakeEngine(), FakeEngine()
    pool = EnginePool([a, b])

    async def main():
        for stream in ("s1", "s2", "s3"):  # a: s1, s3; b: s2
            await pool.transcribe(request(stream))
        pool.release_stream("s1")
        pool.release_stream("s3")
        assert a.released == ["s1", "s3"] and b.released == []
        assert [e["streams"] for e in pool.stats()["engines"]] == [0, 1]
        await pool.transcribe(request("s4"))  # a is the least loaded again
        assert a.calls[-1].request.stream_id == "s4"
        pool.release_stream("never-placed")  # nothing held it: no engine is told
        assert a.released == ["s1", "s3"] and b.released == []

    asyncio.run(main())


def test_ties_in_streams_go_to_the_engine_with_less_work():
    a, b = LoadedFake(), LoadedFake()
    a.rows = {"running": 5, "free_slots": 59, "queue": {"final": 2, "partial": 0}, "batch_sizes": [5]}
    b.rows = {"running": 1, "free_slots": 63, "queue": {"final": 0, "partial": 0}, "batch_sizes": [1]}
    pool = EnginePool([a, b])
    asyncio.run(pool.transcribe(request("s1")))
    assert len(b.calls) == 1 and not a.calls


def test_a_failed_engine_leaves_the_other_serving():
    a, b = FakeEngine(), FakeEngine()
    pool = EnginePool([a, b])

    async def main():
        await pool.transcribe(request("s1"))  # on a
        await pool.transcribe(request("s2"))  # on b
        a.error = EngineClosed("engine 0 died for good")
        a.ready = False
        a.closed = True  # it refuses work as a closed engine does
        assert pool.ready and pool.error is None  # degraded, still serving
        result = await pool.transcribe(request("s1"))  # its engine failed: placed again, on b
        assert result.text == "1.00s" and b.calls[-1].request.stream_id == "s1"
        await pool.transcribe(request("s5"))  # new streams too
        assert b.calls[-1].request.stream_id == "s5"
        assert [e["serving"] for e in pool.stats()["engines"]] == [0, 1]
        b.error, b.ready = EngineClosed("engine 1 died for good"), False
        assert not pool.ready and "every engine failed" in str(pool.error)
        with pytest.raises(EngineClosed):
            await pool.transcribe(request("s6"))

    asyncio.run(main())


def test_a_request_refused_by_an_engine_that_just_failed_is_retried_on_another():
    a, b = FakeEngine(manual=True), FakeEngine()
    pool = EnginePool([a, b])

    async def main():
        task = asyncio.create_task(pool.transcribe(request("s1")))  # placed on a, waiting there
        await a.wait_for_calls(1)
        a.error = EngineClosed("engine 0 died for good")
        a.fail(a.calls[0], EngineClosed("the engine is not running"))
        result = await task
        assert result.text == "1.00s" and [c.request.stream_id for c in b.calls] == ["s1"]

    asyncio.run(main())


def test_a_pool_closing_does_not_retry():
    a, b = FakeEngine(), FakeEngine()
    pool = EnginePool([a, b])

    async def main():
        await pool.close()
        assert a.closed and b.closed and not pool.ready
        with pytest.raises(EngineClosed):
            await pool.transcribe(request("s1"))

    asyncio.run(main())


def no_time():
    return 0.0  # the pool's clock in tests: a round trip takes no time, the fake's timings are the latency


def test_headroom_follows_the_recent_latency_of_finals():
    a = LoadedFake()
    pool = EnginePool([a], LoadPolicy(target_ms=100.0, window_s=60.0), clock=no_time)

    async def main():
        assert pool.stats()["headroom"] == 1.0  # nothing measured yet
        a.queue_ms, a.decode_ms = 20.0, 30.0
        for i in range(10):
            await pool.transcribe(request(f"s{i}"))
        engine = pool.stats()["engines"][0]
        assert engine["final_latency_ms"] == 50.0 and engine["final_queue_ms"] == 20.0
        assert pool.stats()["headroom"] == pytest.approx(0.5)
        a.queue_ms = 500.0  # partials' latency does not count: finals are what the target is about
        await pool.transcribe(request("p", Priority.PARTIAL))
        assert pool.stats()["headroom"] == pytest.approx(0.5)
        for i in range(2):
            await pool.transcribe(request(f"t{i}"))
        assert pool.stats()["headroom"] == pytest.approx(-4.3)  # the p90 of 12 finals is a slow one (530 ms)

    asyncio.run(main())


def test_slow_decodes_behind_a_fast_queue_use_up_the_headroom():
    """Session 5 on the H200: finals waited < 100 ms in the queue and took 600 ms in all. The queue delay never
    crossed its target; the whole latency does."""
    a = LoadedFake()
    pool = EnginePool([a], LoadPolicy(target_ms=180.0, window_s=60.0), clock=no_time)

    async def main():
        a.queue_ms, a.decode_ms = 40.0, 300.0  # a fast queue, slow decodes
        for i in range(10):
            await pool.transcribe(request(f"s{i}"))
        engine = pool.stats()["engines"][0]
        assert engine["final_queue_ms"] == 40.0  # the old signal: 40 of 180, plenty of headroom
        assert engine["final_latency_ms"] == 340.0 and pool.stats()["headroom"] < 0

    asyncio.run(main())


def test_the_latency_is_the_round_trip_when_it_is_longer_than_the_engines_account():
    now = [0.0]

    class Slow(LoadedFake):
        async def transcribe(self, req):
            now[0] += 0.25  # IPC and the worker's event loop: 250 ms the engine never saw
            return await super().transcribe(req)

    a = Slow()
    pool = EnginePool([a], LoadPolicy(target_ms=100.0, window_s=60.0), clock=lambda: now[0])
    a.queue_ms, a.decode_ms = 10.0, 20.0

    async def main():
        await pool.transcribe(request("s"))
        assert pool.stats()["engines"][0]["final_latency_ms"] == pytest.approx(250.0)
        assert pool.stats()["headroom"] == pytest.approx(-1.5)

    asyncio.run(main())


def test_final_latency_ms_counts_the_engines_own_account_and_the_alignment():
    from qasr.engine.pool import final_latency_ms

    pieces = {"queue_ms": 10.0, "encode_ms": 20.0, "prefill_ms": 30.0, "decode_ms": 40.0}
    assert final_latency_ms(pieces, 5.0) == 100.0
    assert final_latency_ms(pieces | {"engine_ms": 120.0}, 5.0) == 120.0  # submit to result, gaps included
    assert final_latency_ms(pieces | {"engine_ms": 120.0, "align_ms": 30.0}, 5.0) == 150.0
    assert final_latency_ms(pieces, 180.0) == 180.0
    assert final_latency_ms({}, 7.0) == 7.0


def test_old_delays_leave_the_window():
    now = [0.0]
    delays = RecentDelays(3.0, clock=lambda: now[0])
    delays.add(200.0)
    now[0] = 2.0
    delays.add(10.0)
    assert delays.p90() == 200.0
    now[0] = 3.5  # the 200 ms one is older than the window
    assert delays.p90() == 10.0
    now[0] = 10.0
    assert delays.p90() == 0.0


def test_headroom_counts_decode_rows_but_not_an_idle_engines_old_steps():
    a = LoadedFake()
    pool = EnginePool([a])
    a.rows = {"running": 8, "free_slots": 0, "queue": {"final": 3, "partial": 0}, "batch_sizes": [8] * 64}
    assert pool.stats()["headroom"] == 0.0  # every row decoding, more waiting
    a.rows = {"running": 6, "free_slots": 2, "queue": {"final": 0, "partial": 0}, "batch_sizes": [4] * 64}
    assert pool.stats()["headroom"] == pytest.approx(0.5)
    a.rows = {"running": 0, "free_slots": 8, "queue": {"final": 0, "partial": 0}, "batch_sizes": [8] * 64}
    assert pool.stats()["headroom"] == 1.0  # its last steps were full, but nothing runs now


def test_the_pool_headroom_is_the_best_serving_engines_and_new_streams_go_where_there_is_headroom():
    a, b = LoadedFake(), LoadedFake()
    pool = EnginePool([a, b], LoadPolicy(target_ms=100.0, window_s=60.0), clock=no_time)

    async def main():
        a.queue_ms = 150.0
        await pool.transcribe(request("s1"))  # a, now past its target
        pool.release_stream("s1")
        b.queue_ms = 20.0
        await pool.transcribe(request("s2"))  # b
        assert [e["headroom"] for e in pool.stats()["engines"]] == [pytest.approx(-0.5), pytest.approx(0.8)]
        assert pool.stats()["headroom"] == pytest.approx(0.8)
        await pool.transcribe(request("s3"))  # b again, though it holds more streams: a has no headroom
        assert [c.request.stream_id for c in b.calls] == ["s2", "s3"]

    asyncio.run(main())


def test_partials_thin_only_past_the_target_and_finals_never_do():
    a = LoadedFake()
    pool = EnginePool([a], LoadPolicy(target_ms=100.0, window_s=60.0), clock=no_time)  # the default levels

    async def partials(stream, count):
        passed = 0
        for _ in range(count):
            try:
                await pool.transcribe(request(stream, Priority.PARTIAL))
                passed += 1
            except Superseded:
                pass
        return passed

    async def main():
        a.decode_ms = 50.0  # headroom 0.5: every partial passes
        await pool.transcribe(request("f0"))
        assert await partials("s1", 8) == 8
        a.queue_ms, a.decode_ms = 0.0, 100.0  # at the target (new streams are refused there): partials still pass,
        for i in range(20):  # the cadence target holds for the streams admitted
            await pool.transcribe(request(f"e{i}"))
        assert pool.stats()["headroom"] == pytest.approx(0.0)
        assert await partials("s0", 8) == 8
        a.decode_ms = 130.0  # headroom -0.3, past the target though refusing: one in two, the first one first
        for i in range(20):
            await pool.transcribe(request(f"f{i}"))
        assert await partials("s2", 8) == 4 and a.calls[-1].request.stream_id == "s2"
        a.decode_ms = 160.0  # headroom -0.6: one in four
        for i in range(20):
            await pool.transcribe(request(f"g{i}"))
        assert await partials("s3", 8) == 2
        assert pool.stats()["partials_thinned"] == 4 + 6
        finals = len(a.calls)
        for i in range(5):
            await pool.transcribe(request(f"h{i}"))
        assert len(a.calls) == finals + 5  # finals always pass

    asyncio.run(main())


def test_thinning_levels_are_the_policys():
    policy = LoadPolicy(thin_levels=((0.3, 2), (0.1, 4)))  # an operator may thin before the target instead
    assert [policy.partials_passed_one_in(h) for h in (0.5, 0.2, 0.05, -1.0)] == [1, 2, 4, 4]
    default = LoadPolicy()
    assert [default.partials_passed_one_in(h) for h in (1.0, 0.0, -0.2, -0.3, -0.6)] == [1, 1, 1, 2, 4]


def test_no_target_no_thinning():
    a = LoadedFake()
    pool = EnginePool([a], LoadPolicy(target_ms=0.0))

    async def main():
        a.decode_ms = 10_000.0
        await pool.transcribe(request("f"))
        for _ in range(4):
            await pool.transcribe(request("s", Priority.PARTIAL))
        assert pool.stats()["headroom"] == 1.0 and pool.stats()["partials_thinned"] == 0

    asyncio.run(main())


def test_ready_start_check_context_and_model_name():
    a, b = FakeEngine(model_name="m", ready=False), FakeEngine(model_name="m", ready=False)
    pool = EnginePool([a, b])

    async def main():
        assert pool.model_name == "m" and not pool.ready
        await pool.start()
        assert a.ready and b.ready and pool.ready
        a.ready = False  # restarting: the pool still serves on b
        assert pool.ready
        await pool.check_context("short", language=None, max_audio_seconds=5.0)
        with pytest.raises(ValueError, match="context too long"):
            await pool.check_context("x" * 600, language=None, max_audio_seconds=5.0)

    asyncio.run(main())


def test_invalid_pools_and_policies_are_refused():
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([])
    with pytest.raises(ValueError, match="target_ms"):
        LoadPolicy(target_ms=-1)
    with pytest.raises(ValueError, match="thin_levels"):
        LoadPolicy(thin_levels=((0.1, 4), (0.3, 2)))
