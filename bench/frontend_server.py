"""The server's front end alone: qasr-server's app on `qasr.engine.fake.FakeEngine` (every request answered after
20 ms, no model, no torch), so `qasr-bench stream --server-pid PID` measures what the event loop itself costs per
stream (WebSocket frames, resampling, VAD, sessions, JSON):

    python -m qasr.bench.frontend_server --port 8799 &   # prints "ready PID PORT"
    qasr-bench stream --url ws://127.0.0.1:8799/v1/stream --clients 200 --duration 20 --stagger-s 5 --server-pid PID
"""

from __future__ import annotations

import argparse
import asyncio
import os

from qasr.engine.fake import FakeEngine
from qasr.server.app import QasrServer, ServerConfig
from qasr.server.limits import ServerLimits


async def serve(port: int, delay_s: float) -> None:
    engine = FakeEngine(delay_s=delay_s)
    await engine.start()
    server = QasrServer(engine, ServerConfig(port=port, ping_interval_s=None, limits=ServerLimits(max_sessions=4096)))
    await server.start()
    print("ready", os.getpid(), server.port, flush=True)
    await asyncio.Event().wait()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m qasr.bench.frontend_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8799, help="0: any free port (printed on the ready line)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="each fake transcription takes this long")
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # Windows
        asyncio.run(serve(args.port, args.delay_ms / 1e3))
        return
    uvloop.run(serve(args.port, args.delay_ms / 1e3))


if __name__ == "__main__":
    main()
