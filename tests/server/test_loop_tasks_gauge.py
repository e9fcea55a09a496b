"""qasr_event_loop_tasks is kept current by the server itself, about every second, not only when a scrape reaches
it: with --workers, /metrics from one worker sums every worker's last value, so a worker that no scrape reached
after the run still showed its mid-run count (the 600-stream H200 soak's idle server read +824 tasks)."""

from __future__ import annotations

import asyncio

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine
from live_server import serving


def test_the_servers_task_count_follows_its_tasks_without_a_scrape():
    async def main():
        async with serving(FakeEngine()) as server:
            gauge = lambda: server.metrics.registry.get_sample_value("qasr_event_loop_tasks")  # noqa: E731
            await asyncio.sleep(1.2)
            idle = gauge()
            parked = [asyncio.create_task(asyncio.sleep(60)) for _ in range(20)]
            await asyncio.sleep(1.2)
            busy = gauge()
            for task in parked:
                task.cancel()
            await asyncio.gather(*parked, return_exceptions=True)
            await asyncio.sleep(1.2)
            return idle, busy, gauge()

    idle, busy, after = asyncio.run(asyncio.wait_for(main(), 30))
    assert idle >= 1 and busy == idle + 20 and after == idle
