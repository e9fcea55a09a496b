"""A telephony platform in a test: builds the frames Twilio, Telnyx, Vonage and Genesys AudioHook send for a call
(two tracks of 8 kHz audio, DTMF at a given time) and plays them to a server at real time in 20 ms frames.

    frames = twilio_call(caller, agent, call_sid="CA1", dtmf=[(2.0, "5")])     # [(at_seconds, frame)]
    await play(url, frames)                                                    # paced by at_seconds

`caller` and `agent` are float32 mono at 8 kHz (the same length); each builder documents its shapes in the
server module it drives (server/twilio.py, telnyx.py, vonage.py, audiohook.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
import uuid

import numpy as np

from qasr.audio.g711 import ALAW_TO_LINEAR, MULAW_TO_LINEAR

RATE = 8000
FRAME = RATE // 50  # 20 ms


def encode_g711(samples: np.ndarray, table: np.ndarray) -> bytes:
    """float32 -> the nearest G.711 code per sample (by the decoder's own table)."""
    order = np.argsort(table)
    linear = np.clip(np.round(samples * 32768.0), -32768, 32767)
    index = np.clip(np.searchsorted(table[order], linear), 1, 255)
    lower, upper = order[index - 1], order[index]
    nearer_upper = np.abs(table[upper] - linear) < np.abs(table[lower] - linear)
    return np.where(nearer_upper, upper, lower).astype(np.uint8).tobytes()


def mulaw(samples: np.ndarray) -> bytes:
    return encode_g711(samples, MULAW_TO_LINEAR)


def alaw(samples: np.ndarray) -> bytes:
    return encode_g711(samples, ALAW_TO_LINEAR)


def l16(samples: np.ndarray, byteorder: str = "<") -> bytes:
    return np.clip(np.round(samples * 32767.0), -32768, 32767).astype(f"{byteorder}i2").tobytes()


def frames_of(samples: np.ndarray, frame: int = FRAME):
    for start in range(0, len(samples), frame):
        yield start, samples[start:start + frame]


# -- Twilio / Telnyx --------------------------------------------------------------------------------------------

def twilio_call(caller: np.ndarray, agent: np.ndarray | None, *, call_sid: str = "CA" + "0" * 32,
                stream_sid: str = "MZ" + "1" * 32, dtmf: list[tuple[float, str]] = (),
                parameters: dict | None = None) -> list[tuple[float, str]]:
    tracks = ["inbound"] + (["outbound"] if agent is not None else [])
    sequence = iter(range(1, 1_000_000))
    frames = [(0.0, json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"})),
              (0.0, json.dumps({"event": "start", "sequenceNumber": str(next(sequence)), "streamSid": stream_sid,
                                "start": {"streamSid": stream_sid, "accountSid": "AC" + "2" * 32, "callSid": call_sid,
                                          "tracks": tracks, "customParameters": parameters or {},
                                          "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000,
                                                          "channels": 1}}}))]
    return frames + _media_frames(caller, agent, dtmf, sequence, lambda n, track, chunk, start, audio: {
        "event": "media", "sequenceNumber": str(n), "streamSid": stream_sid,
        "media": {"track": track, "chunk": str(chunk), "timestamp": str(start * 1000 // RATE),
                  "payload": base64.b64encode(mulaw(audio)).decode()}},
        lambda n, digit: {"event": "dtmf", "sequenceNumber": str(n), "streamSid": stream_sid,
                          "dtmf": {"track": "inbound_track", "digit": digit}},
        lambda n: {"event": "stop", "sequenceNumber": str(n), "streamSid": stream_sid,
                   "stop": {"accountSid": "AC" + "2" * 32, "callSid": call_sid}})


def telnyx_call(caller: np.ndarray, agent: np.ndarray | None, *, call_control_id: str = "v3:call-1",
                stream_id: str = "32de0dea-53cb-4b21-89a4-9e6b7d2b8d5a", encoding: str = "PCMA",
                dtmf: list[tuple[float, str]] = (), shuffle_seed: int | None = None,
                parameters: list | None = None) -> list[tuple[float, str]]:
    """Telnyx frames; with `shuffle_seed`, neighbouring frames swap places now and then (order not guaranteed)."""
    encode = {"PCMU": mulaw, "PCMA": alaw, "L16": lambda audio: l16(audio, ">")}[encoding]
    tracks = ["inbound"] + (["outbound"] if agent is not None else [])
    sequence = iter(range(1, 1_000_000))
    frames = [(0.0, json.dumps({"event": "connected", "version": "1.0.0"})),
              (0.0, json.dumps({"event": "start", "sequence_number": str(next(sequence)), "stream_id": stream_id,
                                "start": {"user_id": str(uuid.uuid4()), "call_control_id": call_control_id,
                                          "from": "+15550100", "to": "+15550199", "tracks": tracks,
                                          "custom_parameters": parameters or [],
                                          "media_format": {"encoding": encoding, "sample_rate": RATE,
                                                           "channels": 1}}}))]
    media = _media_frames(caller, agent, dtmf, sequence, lambda n, track, chunk, start, audio: {
        "event": "media", "sequence_number": str(n), "stream_id": stream_id,
        "media": {"track": track, "chunk": str(chunk), "timestamp": str(start * 1000 // RATE),
                  "payload": base64.b64encode(encode(audio)).decode()}},
        lambda n, digit: {"event": "dtmf", "sequence_number": str(n), "stream_id": stream_id,
                          "dtmf": {"digit": digit}},
        lambda n: {"event": "stop", "sequence_number": str(n), "stream_id": stream_id,
                   "stop": {"call_control_id": call_control_id}})
    if shuffle_seed is not None:
        rng = random.Random(shuffle_seed)
        for index in range(len(media) - 2):  # never past the stop
            if rng.random() < 0.1:
                (at_a, a), (at_b, b) = media[index], media[index + 1]
                media[index], media[index + 1] = (at_a, b), (at_b, a)
    return frames + media


def _media_frames(caller, agent, dtmf, sequence, media, digit, stop) -> list[tuple[float, str]]:
    frames = []
    pending_dtmf = sorted(dtmf)
    for chunk, (start, audio) in enumerate(frames_of(caller), start=1):
        at = start / RATE
        while pending_dtmf and pending_dtmf[0][0] <= at:
            frames.append((at, json.dumps(digit(next(sequence), pending_dtmf.pop(0)[1]))))
        frames.append((at, json.dumps(media(next(sequence), "inbound", chunk, start, audio))))
        if agent is not None:
            frames.append((at, json.dumps(media(next(sequence), "outbound", chunk, start, agent[start:start + FRAME]))))
    frames.append((len(caller) / RATE, json.dumps(stop(next(sequence)))))
    return frames


# -- Vonage -----------------------------------------------------------------------------------------------------

def vonage_call(audio: np.ndarray, *, rate: int = 16000, call_id: str = "vonage-call-1",
                dtmf: list[tuple[float, str]] = ()) -> list[tuple[float, str | bytes]]:
    """`audio` at `rate`: the connected message, binary 20 ms frames, DTMF texts (the socket's close ends it)."""
    frames = [(0.0, json.dumps({"event": "websocket:connected", "content-type": f"audio/l16;rate={rate}",
                                "call_id": call_id}))]
    pending_dtmf = sorted(dtmf)
    for start, chunk in frames_of(audio, rate // 50):
        at = start / rate
        while pending_dtmf and pending_dtmf[0][0] <= at:
            frames.append((at, json.dumps({"event": "websocket:dtmf", "digit": pending_dtmf.pop(0)[1],
                                           "duration": 260})))
        frames.append((at, l16(chunk)))
    return frames


# -- Genesys AudioHook ------------------------------------------------------------------------------------------

class AudioHookClient:
    """Builds AudioHook client messages with correct seq, serverseq and position."""

    def __init__(self, session_id: str | None = None, *, conversation_id: str | None = None):
        self.session_id = session_id or str(uuid.uuid4())
        self.conversation_id = conversation_id or str(uuid.uuid4())
        self.organization_id = str(uuid.uuid4())
        self.seq = 0
        self.serverseq = 0
        self.samples = 0

    @property
    def headers(self) -> dict[str, str]:
        return {"Audiohook-Organization-Id": self.organization_id, "Audiohook-Session-Id": self.session_id,
                "Audiohook-Correlation-Id": str(uuid.uuid4()), "X-API-KEY": "test-key"}

    def message(self, kind: str, parameters: dict | None = None, **override) -> str:
        self.seq += 1
        position = f"PT{self.samples / RATE:.3f}S"
        return json.dumps({"version": "2", "id": self.session_id, "type": kind, "seq": self.seq,
                           "serverseq": self.serverseq, "position": position, "parameters": parameters or {},
                           **override})

    def open(self, *, channels=("external", "internal"), media_format: str = "PCMU", **parameters) -> str:
        offers = [{"type": "audio", "format": media_format, "channels": list(channels), "rate": RATE},
                  {"type": "audio", "format": media_format, "channels": ["external"], "rate": RATE}]
        return self.message("open", {"organizationId": self.organization_id, "conversationId": self.conversation_id,
                                     "participant": {"id": str(uuid.uuid4()), "ani": "+15550100",
                                                     "aniName": "Caller", "dnis": "+15550199"},
                                     "media": offers, **parameters})

    def audio(self, *channels: np.ndarray, media_format: str = "PCMU") -> bytes:
        interleaved = np.stack(channels, axis=1).reshape(-1)
        self.samples += len(channels[0])
        return mulaw(interleaved) if media_format == "PCMU" else l16(interleaved)

    def saw(self, frame: str) -> dict:
        """Note a server message (its seq becomes the next serverseq); returns it parsed."""
        message = json.loads(frame)
        self.serverseq = message["seq"]
        return message


def audiohook_call(client: AudioHookClient, external: np.ndarray,
                   internal: np.ndarray) -> list[tuple[float, str | bytes]]:
    """open, stereo PCMU audio in 20 ms frames with a ping each second, then close (serverseq is the receiver's
    business: play() leaves it at 0, which never exceeds the server's)."""
    frames = [(0.0, client.open())]
    for start, chunk in frames_of(external):
        at = start / RATE
        if start and start % RATE == 0:
            frames.append((at, client.message("ping")))
        frames.append((at, client.audio(chunk, internal[start:start + FRAME])))
    frames.append((len(external) / RATE, client.message("close", {"reason": "end"})))
    return frames


# -- playing ----------------------------------------------------------------------------------------------------

async def play(websocket, frames: list[tuple[float, str | bytes]], *, speed: float = 1.0) -> None:
    """Send each frame at its time (seconds from the first), as the platform would."""
    started = time.monotonic()
    for at, frame in frames:
        delay = at / speed - (time.monotonic() - started)
        if delay > 0:
            await asyncio.sleep(delay)
        await websocket.send(frame)
