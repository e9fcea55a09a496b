"""What each wire adapter costs per client message, against what its wire format costs with no adapter at all: the
floor under bench/frontend_paired.py's ratios. No sockets, no event loop: the same 100 ms of 24 kHz audio as
`--protocol native --sample-rate 24000`, `openai` and `deepgram` clients send it, through

    websocket    websockets' parse of the client frame (unmasking; a text frame's UTF-8 decoding)
    wire         what the format itself makes any server do: OpenAI's JSON parse and base64 decode, Deepgram's
                 sha256 of the audio (its Metadata carries it), then decode_pcm, as native's binary frame needs
    adapter      the adapter's whole receive() (the wire work included)

    python -m qasr.bench.frontend_floor [--chunk-ms 100]

Each figure is the fastest of many small batches, so a busy machine's preemptions drop out; microseconds per message
(x 1000 / chunk-ms: per second of audio). An adapter's own overhead is its `adapter` minus its `wire`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np
from websockets.frames import Frame, Opcode
from websockets.protocol import Protocol, Side, State

from qasr.audio import decode_pcm
from qasr.bench.protocol_clients import DEEPGRAM_QUERY, DEEPGRAM_RATE, OPENAI_RATE, openai_append, \
    openai_session_update, pcm16
from qasr.server.deepgram import DeepgramAdapter
from qasr.server.openai_realtime import OpenAIRealtimeAdapter
from qasr.server.protocol import NativeProtocol
from qasr.server.wire_decode import b64decode, json_loads
from qasr.streaming.settings import StreamLimits, StreamSettings

def client_frame(opcode: Opcode, data: bytes) -> bytes:
    """A masked client frame as it arrives on the socket."""
    client = Protocol(Side.CLIENT, state=State.OPEN)
    client.send_frame(Frame(opcode, data))
    return b"".join(client.data_to_send())


def fastest_us(function, *, batches: int, batch: int = 20) -> float:
    best = float("inf")
    for _ in range(batches):
        began = time.perf_counter_ns()
        for _ in range(batch):
            function()
        best = min(best, (time.perf_counter_ns() - began) / batch / 1e3)
    return best


def measure(chunk_ms: int, batches: int) -> dict[str, dict[str, float]]:
    rate = OPENAI_RATE
    pcm = pcm16((0.1 * np.sin(np.arange(rate * chunk_ms // 1000) / 7)).astype(np.float32))
    append = openai_append(pcm)
    server = Protocol(Side.SERVER, state=State.OPEN, max_size=None)
    binary_frame, text_frame = client_frame(Opcode.BINARY, pcm), client_frame(Opcode.TEXT, append.encode())

    def parse(frame: bytes, text: bool):
        server.receive_data(frame)
        [received] = server.events_received()
        return received.data.decode() if text else received.data

    native = NativeProtocol()
    native.receive(json.dumps({"type": "start", "sample_rate": rate}))
    openai = OpenAIRealtimeAdapter(defaults=StreamSettings(), limits=StreamLimits(), model_name="bench")
    openai.receive(openai_session_update(None))
    deepgram = DeepgramAdapter(DEEPGRAM_QUERY, defaults=StreamSettings(), limits=StreamLimits())
    sha256 = hashlib.sha256()

    def openai_wire():
        decode_pcm(b64decode(json_loads(append)["audio"]), "s16le", 1)

    def deepgram_wire():
        sha256.update(pcm)
        decode_pcm(pcm, "s16le", 1)

    cases = {
        "native": {"websocket": lambda: parse(binary_frame, False), "wire": lambda: decode_pcm(pcm, "s16le", 1),
                   "adapter": lambda: native.receive(pcm)},
        "openai": {"websocket": lambda: parse(text_frame, True), "wire": openai_wire,
                   "adapter": lambda: openai.receive(append)},
        "deepgram": {"websocket": lambda: parse(binary_frame, False), "wire": deepgram_wire,
                     "adapter": lambda: deepgram.receive(pcm)},
    }
    best = {protocol: {part: float("inf") for part in parts} for protocol, parts in cases.items()}
    for _ in range(max(1, batches // 50)):  # interleaved, so a slow spell of the machine reaches every case alike
        for protocol, parts in cases.items():
            for part, function in parts.items():
                best[protocol][part] = min(best[protocol][part], fastest_us(function, batches=50))
    return best


def markdown(best: dict[str, dict[str, float]], chunk_ms: int) -> str:
    native = best["native"]
    lines = [f"| protocol ({chunk_ms} ms of 24 kHz s16le per message) | websocket frame us | wire format us "
             "| adapter receive() us | adapter's own us | frame + receive over native's: us per audio s |",
             "|---|---:|---:|---:|---:|---:|"]
    for protocol, parts in best.items():
        extra = ((parts["websocket"] + parts["adapter"]) - (native["websocket"] + native["adapter"])) * 1000 / chunk_ms
        lines.append(f"| {protocol} | {parts['websocket']:.2f} | {parts['wire']:.2f} | {parts['adapter']:.2f} "
                     f"| {parts['adapter'] - parts['wire']:.2f} | {extra:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m qasr.bench.frontend_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk-ms", type=int, default=100, help="audio per message (default: %(default)s)")
    p.add_argument("--batches", type=int, default=600, help="batches of 20 messages per case (default: %(default)s)")
    args = p.parse_args(argv)
    if args.chunk_ms < 10 or args.batches < 1:
        p.error("need --chunk-ms >= 10 and --batches >= 1")
    if OPENAI_RATE != DEEPGRAM_RATE:
        p.error("the bench's OpenAI and Deepgram clients no longer send the same audio: compare like with like")
    text = markdown(measure(args.chunk_ms, args.batches), args.chunk_ms)
    print(text)
    return text


if __name__ == "__main__":
    main()
