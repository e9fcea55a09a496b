"""The per-request cost of reaching the engine process (issue #15): round trips of a partial's DecodeRequest (5 s of
16 kHz audio, out of band) and a small answer, through the owner's pipe (one server process) and through a worker's
Unix socket connection (`--workers N`), with the framing EngineProcess and EngineClient use. CPU only, no model:
the far end answers at once, so this is the IPC alone.

    python bench/engine_ipc.py [--seconds 5] [--requests 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import secrets
import tempfile
import time

import numpy as np

from qasr.engine.engine_client import receive, send
from qasr.engine.request import DecodeRequest, DecodeResult, Priority


def _echo(conn) -> None:
    """The far end: answer every add at once with a result the size of a partial's."""
    result = DecodeResult(text="word " * 20, language="English", raw_text="language English<asr_text>" + "word " * 20,
                          token_ids=tuple(range(40)), finish_reason="eos", num_audio_tokens=65)
    while True:
        try:
            message = receive(conn)
        except (EOFError, OSError):
            return
        send(conn, ("done", message[1], result))


def _serve_socket(address: str, authkey: bytes) -> None:
    with multiprocessing.connection.Listener(address, family="AF_UNIX", authkey=authkey) as listener:
        _echo(listener.accept())


def round_trips(conn, request: DecodeRequest, count: int) -> float:
    """Seconds per request, one in flight at a time."""
    for i in range(20):  # warm up
        send(conn, ("add", i, request))
        receive(conn)
    start = time.perf_counter()
    for i in range(count):
        send(conn, ("add", i, request))
        receive(conn)
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="audio per request")
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    audio = np.random.default_rng(0).normal(0, 0.1, int(16000 * args.seconds)).astype(np.float32)
    request = DecodeRequest(audio=audio, priority=Priority.PARTIAL, stream_id="bench/0")
    context = multiprocessing.get_context("spawn")

    here, there = context.Pipe()
    process = context.Process(target=_echo, args=(there,), daemon=True)
    process.start()
    there.close()
    pipe = round_trips(here, request, args.requests)
    here.close()
    process.join()

    folder = tempfile.mkdtemp()
    address, authkey = os.path.join(folder, "engine.sock"), secrets.token_bytes(32)
    process = context.Process(target=_serve_socket, args=(address, authkey), daemon=True)
    process.start()
    while True:
        try:
            conn = multiprocessing.connection.Client(address, family="AF_UNIX", authkey=authkey)
            break
        except OSError:
            time.sleep(0.05)
    sock = round_trips(conn, request, args.requests)
    conn.close()
    process.join()
    os.rmdir(folder)
    print(f"a partial with {args.seconds:g} s of audio ({audio.nbytes / 1e3:.0f} kB), {args.requests} round trips:")
    for name, seconds in (("pipe (one server process)", pipe), ("Unix socket (a worker)", sock)):
        print(f"  {name:28s} {seconds * 1e6:7.1f} us per request, {1 / seconds:8.0f} round trips/s")


if __name__ == "__main__":
    main()
