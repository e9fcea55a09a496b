"""The server's front end alone: qasr-server's app on `qasr.engine.fake.FakeEngine` (every request answered after
20 ms, no model, no torch), so `qasr-bench stream --server-pid PID` measures what the event loop itself costs per
stream (WebSocket frames, resampling, VAD, sessions, JSON) in any wire format the app serves:

    python -m qasr.bench.frontend_server --port 8799 &   # prints "ready PID PORT"
    qasr-bench stream --url ws://127.0.0.1:8799 --clients 200 --duration 20 --stagger-s 5 --server-pid PID
    qasr-bench stream --protocol openai --url ws://127.0.0.1:8799 ...   (bench/frontend_protocols.sh runs them all)

Its transcripts are words, about as many per second of audio as speech has, growing with the audio a request
carries: events are the size a real model's are, and an OpenAI client's append-only deltas flow as they would.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from qasr.engine.fake import SAMPLE_RATE, FakeEngine
from qasr.server.app import QasrServer, ServerConfig
from qasr.server.limits import ServerLimits
from qasr.server.security import SecuritySettings


WORDS_PER_SECOND = 2.5  # of speech, about what English speakers say
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "callers", "wait")


def spoken_words(num_samples: int) -> str:
    """A transcript for this much 16 kHz audio: words that only grow as the audio does (a partial's text is a
    prefix of the next one's)."""
    count = max(1, round(num_samples / SAMPLE_RATE * WORDS_PER_SECOND))
    return " ".join(WORDS[i % len(WORDS)] for i in range(count))


class SpeakingFakeEngine(FakeEngine):
    """FakeEngine whose transcripts are `spoken_words` of the request's audio."""

    @staticmethod
    def result_for(request, text=None):
        return FakeEngine.result_for(request, spoken_words(len(request.audio)) if text is None else text)


async def serve(port: int, delay_s: float) -> None:
    engine = SpeakingFakeEngine(delay_s=delay_s)
    await engine.start()
    # every bench client connects from 127.0.0.1 at once: the per-address handshake limit (64) would refuse them
    server = QasrServer(engine, ServerConfig(port=port, ping_interval_s=None, limits=ServerLimits(max_sessions=4096),
                                             security=SecuritySettings(max_pending_per_address=4096)))
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
