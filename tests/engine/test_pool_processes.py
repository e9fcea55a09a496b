"""EnginePool over two real engine processes (the tiny model on the CPU): streams are spread over both, a stream's
partials reuse what its own engine keeps for it, release frees it there, and killing one engine process for good
leaves the pool serving every stream on the other."""

import asyncio
import os
import signal
import time

import pytest

from qasr.engine.engine import EngineOptions
from qasr.engine.engine_process import EngineProcess
from qasr.engine.pool import EnginePool
from qasr.engine.request import DecodeRequest, Priority

from test_engine import speech

OPTIONS = EngineOptions(num_slots=4, max_len=256, num_retained=4)


async def until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def partial(stream_id: str, samples: int) -> DecodeRequest:
    return DecodeRequest(audio=speech(10.0, seed=3)[:samples], priority=Priority.PARTIAL, stream_id=stream_id,
                         max_new_tokens=4)


@pytest.mark.slow
def test_two_engine_processes_share_the_streams_and_one_failing_leaves_the_other(tiny_model_dir):
    engines = [EngineProcess(str(tiny_model_dir), device="cpu", dtype="float32", options=OPTIONS, max_restarts=0)
               for _ in range(2)]
    pool = EnginePool(engines)

    def cached() -> list[int]:
        return [engine.get("streams_cached", -1) for engine in pool.stats()["engines"]]

    async def main():
        await pool.start()
        try:
            assert pool.ready
            for stream in ("s1", "s2"):  # one on each engine
                await pool.transcribe(partial(stream, 144000))  # 9 s: one whole encoder window
            await until(lambda: cached() == [1, 1])
            await pool.transcribe(partial("s1", 160000))  # its next partial: on its engine, which kept its window

            def reused() -> list[int]:
                return [e.get("counters", {}).get("reused_windows", 0) for e in pool.stats()["engines"]]

            await until(lambda: reused()[0] > 0)  # the stats arrive a little after the result
            assert reused()[1] == 0 and cached() == [1, 1]
            pool.release_stream("s1")
            await until(lambda: cached() == [0, 1])

            os.kill(engines[0].pid, signal.SIGKILL)  # no restart budget: engine 0 is gone for good
            await until(lambda: engines[0].error is not None)
            assert pool.ready and pool.error is None
            assert [e["serving"] for e in pool.stats()["engines"]] == [0, 1]
            results = await asyncio.gather(*(pool.transcribe(partial(s, 16000)) for s in ("s3", "s4", "s5")))
            assert all(r.finish_reason in ("eos", "length", "repetition") for r in results)
            await until(lambda: cached()[1] == 4)  # s2 and the three new ones, all on engine 1
            final = await pool.transcribe(DecodeRequest(audio=speech(1.0, seed=5), stream_id="s3", max_new_tokens=4))
            assert final.timings["queue_ms"] >= 0
        finally:
            await pool.close()

    asyncio.run(main())
