"""The per-request cost of reaching the engine process (issue #15): a partial's DecodeRequest (its whole segment so
far, 16 kHz float32, out of band) sent to a far end that answers at once with a result the size of a partial's,
through the owner's pipe (one server process) and through a worker's Unix socket connection (`--workers N`). CPU
only, no model: this is the IPC alone.

What it reports, per request and per audio length:
- the receiving thread's CPU time (time.thread_time around `receive` in the far end's reader thread: what the engine
  process's `qasr-engine-client` readers spend). It includes the kernel's copy out of the socket, which runs in the
  read syscall with the GIL released; the rest holds the GIL;
- the sending thread's CPU time in `send` (what a worker's sender thread spends);
- the round trip, one request in flight at a time;
- `prompting.validate`'s finiteness check on the longest audio, before and after.

Each is measured for the framing that qasr uses now (qasr.engine.engine_client.send/receive) and for the framing
before #15's receive change (`legacy_send`/`legacy_receive` below: multiprocessing's send_bytes/recv_bytes, one
message per out-of-band buffer), in the same run.

    python bench/engine_ipc.py [--seconds 1 5 15 30] [--requests 300] [--out DIR]

--out DIR writes DIR/engine_ipc.json as well as the table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import tempfile
import time
from pathlib import Path

import numpy as np

from qasr.engine import engine_client
from qasr.engine.request import DecodeRequest, DecodeResult, Priority

WARM_UP = 20  # requests per audio length before the counters start


def legacy_send(conn, message) -> None:
    """The framing before the change: the pickle, then each out-of-band buffer as one more Connection message."""
    buffers = []
    header = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    conn.send_bytes(len(buffers).to_bytes(4, "little") + header)
    for buffer in buffers:
        conn.send_bytes(buffer.raw())


def legacy_receive(conn):
    data = conn.recv_bytes()
    buffers = [conn.recv_bytes() for _ in range(int.from_bytes(data[:4], "little"))]
    return pickle.loads(data[4:], buffers=buffers)


FRAMINGS = {"before": (legacy_send, legacy_receive), "now": (engine_client.send, engine_client.receive)}


class _ThreadClock:
    """The calling thread's CPU seconds, summed over `with` blocks."""

    def __init__(self):
        self.cpu = 0.0
        self.count = 0

    def __enter__(self):
        self._start = time.thread_time()

    def __exit__(self, *exc):
        self.cpu += time.thread_time() - self._start
        self.count += 1


def _echo(conn, framing: str) -> None:
    """The far end: answer every add at once; ("report",) answers with the receive clock so far and resets it."""
    send, receive = FRAMINGS[framing]
    result = DecodeResult(text="word " * 20, language="English", raw_text="language English<asr_text>" + "word " * 20,
                          token_ids=tuple(range(40)), finish_reason="eos", num_audio_tokens=65)
    clock = _ThreadClock()
    while True:
        try:
            with clock:
                message = receive(conn)
        except (EOFError, OSError):
            return
        if message[0] == "report":
            send(conn, ("report", clock.cpu, clock.count - 1))  # not counting the report itself
            clock = _ThreadClock()
        else:
            assert message[2].audio.shape == (message[2].audio.size,) and message[2].audio.dtype == np.float32
            send(conn, ("done", message[1], result))


def _serve_socket(address: str, authkey: bytes, framing: str) -> None:
    with multiprocessing.connection.Listener(address, family="AF_UNIX", authkey=authkey) as listener:
        _echo(listener.accept(), framing)


def measure(conn, framing: str, request: DecodeRequest, count: int) -> dict:
    """Per request: round trip, the sender's CPU in send, the receiver's CPU in receive."""
    send, receive = FRAMINGS[framing]
    for i in range(WARM_UP):
        send(conn, ("add", i, request))
        receive(conn)
    send(conn, ("report",))
    receive(conn)  # resets the far end's clock
    sending = _ThreadClock()
    start = time.perf_counter()
    for i in range(count):
        with sending:
            send(conn, ("add", i, request))
        receive(conn)
    round_trip = (time.perf_counter() - start) / count
    send(conn, ("report",))
    _, cpu, received = receive(conn)
    assert received == count, (received, count)
    return {"round_trip_us": round_trip * 1e6, "send_cpu_us": sending.cpu / count * 1e6,
            "receive_cpu_us": cpu / count * 1e6}


def run_pipe(framing: str, requests: dict[float, DecodeRequest], count: int) -> dict[float, dict]:
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=_echo, args=(there, framing), daemon=True)
    process.start()
    there.close()
    try:
        return {seconds: measure(here, framing, request, count) for seconds, request in requests.items()}
    finally:
        here.close()
        process.join()


def run_socket(framing: str, requests: dict[float, DecodeRequest], count: int) -> dict[float, dict]:
    context = multiprocessing.get_context("spawn")
    folder = tempfile.mkdtemp()
    address, authkey = os.path.join(folder, "engine.sock"), secrets.token_bytes(32)
    process = context.Process(target=_serve_socket, args=(address, authkey, framing), daemon=True)
    process.start()
    while True:
        try:
            conn = multiprocessing.connection.Client(address, family="AF_UNIX", authkey=authkey)
            break
        except OSError:
            time.sleep(0.05)
    try:
        return {seconds: measure(conn, framing, request, count) for seconds, request in requests.items()}
    finally:
        conn.close()
        process.join()
        os.rmdir(folder)


def finite_check(seconds: float, repeats: int = 200) -> dict:
    """The admission's finiteness check (host_copy.all_finite) on `seconds` of audio: the whole-array isfinite
    before, qasr's now."""
    from qasr.engine.host_copy import all_finite

    audio = np.random.default_rng(1).normal(0, 0.1, int(16000 * seconds)).astype(np.float32)
    out = {}
    for name, check in (("before", lambda: bool(np.isfinite(audio).all())), ("now", lambda: all_finite(audio))):
        assert check()
        clock = _ThreadClock()
        for _ in range(repeats):
            with clock:
                check()
        out[f"{name}_cpu_us"] = clock.cpu / repeats * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, nargs="+", default=[1.0, 5.0, 15.0, 30.0],
                        help="audio per request (one measurement per length)")
    parser.add_argument("--requests", type=int, default=300, help="round trips per length")
    parser.add_argument("--out", type=Path, help="also write engine_ipc.json here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    requests = {seconds: DecodeRequest(audio=rng.normal(0, 0.1, int(16000 * seconds)).astype(np.float32),
                                       priority=Priority.PARTIAL, stream_id="bench/0")
                for seconds in args.seconds}
    results = {}
    for transport, run in (("pipe", run_pipe), ("socket", run_socket)):
        for framing in FRAMINGS:
            results[f"{transport}/{framing}"] = run(framing, requests, args.requests)
    check = finite_check(max(args.seconds))

    print(f"per request, {args.requests} round trips per length (us of the thread's CPU; the round trip's wall time):")
    print(f"  {'transport':9s} {'framing':7s} {'audio':>6s} {'kB':>6s} {'receive cpu':>12s} {'send cpu':>9s} "
          f"{'round trip':>11s}")
    for name, rows in results.items():
        transport, framing = name.split("/")
        for seconds, row in rows.items():
            print(f"  {transport:9s} {framing:7s} {seconds:5g}s {16000 * seconds * 4 / 1e3:6.0f} "
                  f"{row['receive_cpu_us']:12.1f} {row['send_cpu_us']:9.1f} {row['round_trip_us']:11.1f}")
    print(f"prompting.validate's finiteness check, {max(args.seconds):g} s of audio: "
          f"before {check['before_cpu_us']:.1f} us, now {check['now_cpu_us']:.1f} us")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"requests": args.requests,
                  "ipc": {name: {f"{seconds:g}": row for seconds, row in rows.items()}
                          for name, rows in results.items()},
                  "finite_check": {"seconds": max(args.seconds)} | check}
        (args.out / "engine_ipc.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
