"""Socket-level fuzzing of a live server on the tiny model (CPU): hand-built WebSocket frames with random opcodes
(reserved ones included), RSV bits, unmasked frames, oversized control frames, huge declared lengths, messages
fragmented into many continuation frames, truncated frames, and bytes that are not HTTP at all; many connections
at once, for a bounded time. Afterwards /healthz is 200, no connection is left behind, and a normal stream still
gets one final per segment.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from fakes import speech_like, to_s16le
from live_server import real_engine, serving

FUZZ_SECONDS = float(os.environ.get("QASR_SOCKET_FUZZ_SECONDS", "4"))
PARALLEL = 6
START = json.dumps({"type": "start", "vad": {"pre_roll_ms": 0}})


def frame(opcode: int, payload: bytes, *, fin: bool = True, mask: bool = True, rsv: int = 0,
          declared: int | None = None) -> bytes:
    length = len(payload) if declared is None else declared
    head = bytes([(0x80 if fin else 0) | (rsv << 4) | opcode])
    mask_bit = 0x80 if mask else 0
    if length < 126:
        head += bytes([mask_bit | length])
    elif length < 1 << 16:
        head += bytes([mask_bit | 126]) + length.to_bytes(2, "big")
    else:
        head += bytes([mask_bit | 127]) + length.to_bytes(8, "big")
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(byte ^ key[index % 4] for index, byte in enumerate(payload))


def attack(rng: random.Random) -> list[bytes]:
    """One connection's bytes after the handshake."""
    kind = rng.choice(["random_frames", "fragmented", "huge", "garbage", "control", "truncated"])
    if kind == "random_frames":
        return [frame(rng.choice([0, 1, 2, 3, 7, 8, 9, 10, 11, 15]), rng.randbytes(rng.randrange(0, 300)),
                      fin=rng.random() < 0.8, mask=rng.random() < 0.9, rsv=rng.choice([0, 0, 0, 1, 4]))
                for _ in range(rng.randrange(1, 12))]
    if kind == "fragmented":  # a start, then an audio message in many pieces with pings between
        pieces = [frame(1, START.encode())]
        audio = rng.randbytes(2 * rng.randrange(100, 4000))
        cuts = sorted(rng.sample(range(1, len(audio)), min(20, len(audio) - 1)))
        chunks = [audio[a:b] for a, b in zip([0, *cuts], [*cuts, len(audio)])]
        for index, chunk in enumerate(chunks):
            pieces.append(frame(2 if index == 0 else 0, chunk, fin=index == len(chunks) - 1))
            if rng.random() < 0.3:
                pieces.append(frame(9, b"p"))
        if rng.random() < 0.5:
            pieces.append(frame(2, rng.randbytes(64), fin=False) + frame(1, b"{}"))  # a new message mid-message
        return pieces
    if kind == "huge":  # a length over max_size, then a little of it
        return [frame(2, rng.randbytes(1000), declared=rng.choice([2 << 20, 1 << 40, (1 << 63) - 1]))]
    if kind == "garbage":
        return [rng.randbytes(rng.randrange(1, 2000))]
    if kind == "control":  # control frames may not be fragmented nor longer than 125 bytes
        return [frame(rng.choice([8, 9, 10]), rng.randbytes(rng.choice([126, 300, 2])), fin=rng.random() < 0.5)]
    return [frame(1, START.encode())[:rng.randrange(1, 8)]]


async def fuzz_connection(port: int, rng: random.Random) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if rng.random() < 0.1:
            writer.write(rng.randbytes(rng.randrange(1, 500)) + b"\r\n\r\n")  # not HTTP at all
        else:
            key = base64.b64encode(rng.randbytes(16)).decode()
            writer.write(f"GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            for piece in attack(rng):
                writer.write(piece)
                await writer.drain()
        with contextlib.suppress(asyncio.TimeoutError):
            while await asyncio.wait_for(reader.read(65536), 0.5 if rng.random() < 0.7 else 0.05):
                pass
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
        pass  # the server closed on us: fine
    finally:
        writer.transport.abort() if rng.random() < 0.5 else writer.close()


async def http_status(port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status = int((await reader.readline()).split()[1])
    writer.close()
    return status


def test_the_server_survives_socket_level_fuzzing_and_still_serves(tiny_model_dir):
    audio, _ = speech_like([("silence", 0.3), ("speech", 1.2), ("silence", 0.8), ("speech", 1.0), ("silence", 0.8)])

    async def fuzz_worker(port: int, seed: int, deadline: float) -> int:
        rng, count = random.Random(seed), 0
        while asyncio.get_running_loop().time() < deadline:
            await fuzz_connection(port, rng)
            count += 1
        return count

    async def main():
        async with serving(real_engine(tiny_model_dir), max_message_bytes=1 << 20, idle_timeout_s=2.0,
                           drain_timeout_s=2.0) as server:
            deadline = asyncio.get_running_loop().time() + FUZZ_SECONDS
            counts = await asyncio.gather(*(fuzz_worker(server.port, seed, deadline) for seed in range(PARALLEL)))
            for _ in range(300):  # every fuzzed connection is torn down (finals due, close handshakes: seconds)
                if not server.connections:
                    break
                await asyncio.sleep(0.1)
            left = list(server.connections)
            health = await http_status(server.port, "/healthz")
            ready = await http_status(server.port, "/readyz")
            async with connect(f"ws://127.0.0.1:{server.port}/v1/stream") as websocket:
                await websocket.send(START)
                for offset in range(0, len(audio) * 2, 6400):
                    await websocket.send(to_s16le(audio)[offset:offset + 6400])
                await websocket.send('{"type": "end"}')
                out = []
                with contextlib.suppress(ConnectionClosed):
                    async for message in websocket:
                        out.append(json.loads(message))
            return sum(counts), left, health, ready, out, websocket.close_code

    num_fuzzed, left, health, ready, out, code = asyncio.run(asyncio.wait_for(main(), FUZZ_SECONDS + 120))
    assert num_fuzzed >= PARALLEL and left == []
    assert health == 200 and ready == 200
    finals = [event for event in out if event["type"] == "final"]
    assert code == 1000 and out[-1]["type"] == "summary" and len(finals) == out[-1]["segments"] == 2
