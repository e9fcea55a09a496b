"""The wire clients of `qasr-bench stream`: one live stream per client in the protocol asked for. Each fills a
`ClientRecord` with what it saw as events in the native schema (`speech_started`, `partial`, `final`, `error` with
`segment_id`, stream times in seconds, and `channel` where a stream has several), so one analysis serves them all.

    native  /v1/stream through qasr.client's StreamClient (the client library users stream with): `start`, binary
            PCM chunks (16 kHz s16le, or --sample-rate/--encoding: 24 kHz s16le as an OpenAI client sends, 8 kHz
            mulaw as a Twilio call), `end`; the events as sent.
    openai  /v1/realtime?intent=transcription, plain websockets (the server's cost is measured, not an SDK's):
            `session.update` (audio/pcm 24 kHz, server_vad), base64 `input_audio_buffer.append` events, then a
            `commit` (the open turn ends) and a `session.update` that answers after every event made before it.
            speech_started -> speech_started, delta -> partial (no audio end: no partial latency),
            completed -> final whose latency is speech_stopped -> completed of its item, on arrival.
    deepgram  /v1/listen?encoding=linear16&sample_rate=24000&interim_results=true&vad_events=true: binary PCM
            chunks (the same audio and messages as an OpenAI client's, without base64 JSON), then `CloseStream`;
            SpeechStarted -> speech_started, Results -> partial / final (the n-th final is the n-th segment's),
            Metadata ends the stream.
    twilio  one call on /v1/twilio: `connected`, `start` (audio/x-mulaw 8 kHz, the inbound track or both), 20 ms
            `media` frames, `stop`. The transcripts come from /v1/calls/{callSid}/events, subscribed before `start`
            (native events plus channel/track); the call is drained once `call_ended` arrives.

Every client paces its audio in real time (or --speed times faster): chunk k goes out once it would be complete
live, and how late each send finished is its send lag.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from qasr.audio import SAMPLE_RATE, g711
from qasr.client import ClientError, StreamClient, StreamClosed, StreamOptions, Summary
from qasr.streaming.settings import VadSettings

OPENAI_RATE = 24000  # Hz: OpenAI's audio/pcm
OPENAI_TURN_DETECTION = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}
TWILIO_RATE = 8000  # Hz: Twilio's audio/x-mulaw
TWILIO_FRAME = TWILIO_RATE // 50  # samples: Twilio sends 20 ms per media message
TWILIO_TRACKS = ("inbound", "outbound")  # in channel order
DEEPGRAM_RATE = 24000  # Hz: the bench's Deepgram clients send what its OpenAI clients send, as binary linear16
DEEPGRAM_QUERY = (f"encoding=linear16&sample_rate={DEEPGRAM_RATE}&channels=1&interim_results=true&vad_events=true"
                  "&utterance_end_ms=1000&model=nova-3")
PATHS = {"native": "/v1/stream", "openai": "/v1/realtime?intent=transcription", "twilio": "/v1/twilio",
         "deepgram": f"/v1/listen?{DEEPGRAM_QUERY}"}
OPEN_TIMEOUT_S = 30.0
MEDIA_CLOSE_TIMEOUT_S = 10.0  # after call_ended


@dataclass
class ClientRecord:
    index: int
    t0: float = 0.0  # perf_counter when the first audio chunk began (chunk k is due at t0 + (k + 1) * chunk)
    speed: float = 1.0
    pre_roll_s: float = 0.0  # the stream's VAD pre-roll: a segment's start is this much before its speech
    session_id: str = ""  # the session's (native), OpenAI session's or call's id
    events: list[tuple[float, dict]] = field(default_factory=list)  # (arrival perf_counter, native-schema event)
    send_lag_ms: list[float] = field(default_factory=list)
    lag_series: list[tuple[float, float]] = field(default_factory=list)  # (seconds since bench start, lag ms)
    audio_seconds: float = 0.0  # of the stream's timeline (a two-track call counts its length once)
    close_code: int | None = None  # of the stream's connection, as this client saw it closed
    error: str = ""
    drained: bool = False  # every final came before the drain timeout (native: the summary; twilio: call_ended)

    def spoken_at(self, stream_seconds: float) -> float:
        """When this stream time would have been captured live (perf_counter)."""
        return self.t0 + stream_seconds / self.speed


def endpoint(url: str, protocol: str) -> str:
    """The protocol's URL on the server `url` names: a URL without a path gets the protocol's path."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise ValueError(f"the server URL must start with ws:// or wss://, got {url!r}")
    if parts.path not in ("", "/"):
        return url
    path, _, query = PATHS[protocol].partition("?")
    return urlunsplit((parts.scheme, parts.netloc, path, query, ""))


async def paced(record: ClientRecord, num_chunks: int, chunk_s: float, *, stop_at: float, bench_start: float,
                done: asyncio.Future) -> AsyncIterator[int]:
    """Yields chunk numbers as each chunk is due live (every `chunk_s` seconds), and records how late the caller's
    send of it finished. Stops early once `done` (the receiver) has finished, or at `stop_at` if that is later than
    the audio's own end: a client whose handshake took a while still streams all its audio on time (a CI host under
    load once sent 5.5 of 6 s), while one that falls behind stops at the bench's end."""
    record.t0 = time.perf_counter()
    stop_at = max(stop_at, record.t0 + num_chunks * chunk_s)
    for k in range(num_chunks):
        due = record.t0 + (k + 1) * chunk_s  # a live source has the chunk once it is full
        now = time.perf_counter()
        if now >= stop_at or done.done():
            return
        if due > now:
            await asyncio.sleep(due - now)
        yield k
        now = time.perf_counter()
        lag_ms = max(0.0, (now - due) * 1e3)
        record.send_lag_ms.append(lag_ms)
        record.lag_series.append((now - bench_start, lag_ms))


def pcm16(samples: np.ndarray) -> bytes:
    """float32 [-1, 1] -> 16-bit little-endian PCM."""
    return np.clip(np.round(samples * 32767.0), -32768, 32767).astype("<i2").tobytes()


# ---- native ------------------------------------------------------------------------------------------------------


NATIVE_ENCODINGS = ("s16le", "mulaw")  # --encoding: what a plain client sends, what a Twilio call sends


async def run_native(args, record: ClientRecord, tracks: list[np.ndarray], stop_at: float,
                     bench_start: float) -> None:
    """One native stream through qasr.client's StreamClient, its audio sent at --sample-rate in --encoding: 16 kHz
    s16le by default; 24 kHz s16le is what an OpenAI client sends, 8 kHz mulaw in 20 ms what a Twilio call sends.
    The chunks are cut ahead; StreamClient encodes each as it sends it (a send's lag includes that, as a real
    client's would). --words asks for word times on every final (the forced aligner's cost under load)."""
    import soxr

    rate = args.sample_rate
    audio = tracks[0] if rate == SAMPLE_RATE else soxr.resample(tracks[0], SAMPLE_RATE, rate).astype(np.float32)
    chunk = int(args.chunk_ms * rate / 1000)
    chunks = [audio[k * chunk : (k + 1) * chunk] for k in range(-(-len(audio) // chunk))]
    options = StreamOptions(sample_rate=rate, encoding=args.encoding, language=args.language or None,
                            partial_interval_ms=args.partial_interval_ms, words=args.words)
    client = StreamClient(endpoint(args.url, "native"), options, open_timeout_s=OPEN_TIMEOUT_S)
    try:
        ready = await client.connect()
    except StreamClosed as closed:  # turned away: full, not ready, an option it cannot take
        record.error = (f"refused: {closed.error.code}: {closed.error.message}" if closed.error is not None
                        else f"{type(closed).__name__}: {closed}")
        record.close_code = client.close_code
        return
    except (ClientError, OSError) as error:  # unreachable, or the handshake refused
        record.error = f"{type(error).__name__}: {error}"
        return
    try:
        record.session_id = ready.session_id
        record.pre_roll_s = ready.config.get("vad", {}).get("pre_roll_ms", 0) / 1000

        async def receive() -> None:
            try:
                async for event in client.events():  # until the server closes
                    record.events.append((time.perf_counter(), {"type": event.TYPE, **dataclasses.asdict(event)}))
                    if isinstance(event, Summary):
                        record.drained = True
            except StreamClosed as closed:  # closed otherwise than after the summary
                record.error = f"closed by the server: {closed}"
            if not record.drained:
                record.error = record.error or "closed by the server before the summary"

        receiving = asyncio.ensure_future(receive())
        async for k in paced(record, len(chunks), chunk / rate / args.speed, stop_at=stop_at,
                             bench_start=bench_start, done=receiving):
            await client.send_audio(chunks[k])
            record.audio_seconds += len(chunks[k]) / rate
        if not receiving.done():
            await client.end()
        await _drain(receiving, args.drain_timeout_s, record)
    except (ClientError, OSError) as error:
        record.error = record.error or f"{type(error).__name__}: {error}"
    finally:
        await client.close()
        record.close_code = client.close_code


async def _drain(receiving: asyncio.Future, timeout_s: float, record: ClientRecord) -> None:
    try:
        await asyncio.wait_for(asyncio.shield(receiving), timeout_s)
    except asyncio.TimeoutError:
        receiving.cancel()
        record.error = record.error or f"not drained within --drain-timeout-s {timeout_s:g}"


# ---- OpenAI Realtime ---------------------------------------------------------------------------------------------


def openai_session_update(language: str | None) -> str:
    """The GA `session.update` of a transcription session: 24 kHz PCM, server VAD, the language if forced."""
    transcription = {"model": "qwen3-asr", **({"language": language} if language else {})}
    return json.dumps({"type": "session.update", "session": {
        "type": "transcription",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": OPENAI_RATE}, "transcription": transcription,
                            "turn_detection": OPENAI_TURN_DETECTION}}}})


def openai_append(pcm: bytes) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})


OPENAI_COMMIT = json.dumps({"type": "input_audio_buffer.commit"})
OPENAI_SYNC = json.dumps({"type": "session.update", "session": {"type": "transcription"}})  # changes nothing


class OpenAITranscripts:
    """A Realtime transcription session's server events -> native-schema events for a ClientRecord. An item is a
    segment (numbered in the order its speech started); `pending` holds the items that have no completed (or
    failed) yet."""

    def __init__(self):
        self.segments: dict[str, int] = {}  # item_id -> segment number
        self.stopped: dict[str, tuple[float, float]] = {}  # item_id -> (speech_stopped arrival, audio end s)
        self.pending: set[str] = set()
        self.updates = 0  # session.updated events seen
        self.deltas = 0

    def take(self, arrived: float, message: dict) -> dict | None:
        """The native event this server event stands for, or None."""
        kind = message.get("type")
        item_id = message.get("item_id")
        if kind == "session.updated":
            self.updates += 1
        elif kind == "input_audio_buffer.speech_started":
            self.segments[item_id] = len(self.segments)
            self.pending.add(item_id)
            return {"type": "speech_started", "segment_id": self.segments[item_id],
                    "start": message["audio_start_ms"] / 1000}
        elif kind == "input_audio_buffer.speech_stopped":
            self.stopped[item_id] = (arrived, message["audio_end_ms"] / 1000)
        elif kind == "conversation.item.input_audio_transcription.delta":
            self.deltas += 1
            return {"type": "partial", "segment_id": self.segments.get(item_id), "text": message.get("delta", "")}
        elif kind == "conversation.item.input_audio_transcription.completed":
            self.pending.discard(item_id)
            stopped_at, end = self.stopped.get(item_id, (None, None))
            return {"type": "final", "segment_id": self.segments.get(item_id), "text": message.get("transcript", ""),
                    "end": end, "latency_ms": None if stopped_at is None else (arrived - stopped_at) * 1e3}
        elif kind == "conversation.item.input_audio_transcription.failed":
            self.pending.discard(item_id)
            return {"type": "error", "code": "transcription_failed", "segment_id": self.segments.get(item_id),
                    "message": json.dumps(message.get("error"))}
        elif kind == "error":
            error = message.get("error") or {}
            return {"type": "error", "code": error.get("code"), "message": error.get("message", "")}
        return None


async def open_websocket(url: str, record: ClientRecord):
    """A plain websockets client connection (no compression, any message size), or None with record.error set."""
    try:
        return await connect(url, open_timeout=OPEN_TIMEOUT_S, max_size=None, compression=None)
    except (OSError, InvalidHandshake, asyncio.TimeoutError) as error:
        record.error = f"{type(error).__name__}: {error}"
        return None


async def send_paced(websocket, record: ClientRecord, audio: np.ndarray, rate: int, frame, args, stop_at: float,
                     bench_start: float, receiving: asyncio.Future) -> None:
    """Send `audio` (float32 at `rate`) in --chunk-ms pieces at real time x --speed, each as frame(its s16le bytes)."""
    chunk = int(args.chunk_ms * rate / 1000)
    async for k in paced(record, -(-len(audio) // chunk), chunk / rate / args.speed, stop_at=stop_at,
                         bench_start=bench_start, done=receiving):
        piece = audio[k * chunk : (k + 1) * chunk]
        await websocket.send(frame(pcm16(piece)))
        record.audio_seconds += len(piece) / rate


async def run_openai(args, record: ClientRecord, tracks: list[np.ndarray], stop_at: float,
                     bench_start: float) -> None:
    """One OpenAI Realtime transcription session."""
    import soxr

    audio = soxr.resample(tracks[0], SAMPLE_RATE, OPENAI_RATE).astype(np.float32)
    record.pre_roll_s = OPENAI_TURN_DETECTION["prefix_padding_ms"] / 1000
    transcripts = OpenAITranscripts()
    websocket = await open_websocket(endpoint(args.url, "openai"), record)
    if websocket is None:
        return
    synced = asyncio.Event()  # the answer to OPENAI_SYNC: every event made before it has arrived
    configured = asyncio.Event()

    async def receive() -> None:
        try:
            async for frame in websocket:
                arrived, message = time.perf_counter(), json.loads(frame)
                if message.get("type") == "session.created":
                    record.session_id = message["session"]["id"]
                event = transcripts.take(arrived, message)
                if event is not None:
                    record.events.append((arrived, event))
                if transcripts.updates >= 1:
                    configured.set()
                if transcripts.updates >= 2:
                    synced.set()
                if synced.is_set() and not transcripts.pending:
                    record.drained = True
                    return
        except ConnectionClosed as closed:
            record.error = f"closed by the server: {closed}"
        if not record.drained:
            record.error = record.error or "closed by the server before every item completed"

    receiving = asyncio.ensure_future(receive())
    try:
        await websocket.send(openai_session_update(args.language))
        configured_or_closed = asyncio.ensure_future(configured.wait())
        await asyncio.wait({configured_or_closed, receiving}, timeout=OPEN_TIMEOUT_S,
                           return_when=asyncio.FIRST_COMPLETED)
        configured_or_closed.cancel()
        if not configured.is_set():
            record.error = record.error or "no session.updated after session.update"
            return
        await send_paced(websocket, record, audio, OPENAI_RATE, openai_append, args, stop_at, bench_start, receiving)
        if not receiving.done():
            await websocket.send(OPENAI_COMMIT)  # server_vad too: the open turn ends, its item completes
            await websocket.send(OPENAI_SYNC)
        await _drain(receiving, args.drain_timeout_s, record)
    except ConnectionClosed as closed:
        record.error = record.error or f"closed by the server: {closed}"
    finally:
        receiving.cancel()
        await websocket.close()
        record.close_code = websocket.close_code


# ---- Deepgram live ----------------------------------------------------------------------------------------------


DEEPGRAM_CLOSE = json.dumps({"type": "CloseStream"})


class DeepgramTranscripts:
    """A Deepgram live stream's messages -> native-schema events for a ClientRecord. Deepgram names no segments:
    each SpeechStarted opens the next one (vad_events=true), and each final Results (is_final) is the oldest open
    segment's; interim Results are the newest open segment's partials."""

    def __init__(self):
        self.started = 0  # SpeechStarted messages seen
        self.finals = 0  # final Results seen
        self.ended = False  # Metadata (the summary after CloseStream) arrived

    def take(self, message: dict) -> dict | None:
        kind = message.get("type")
        if kind == "SpeechStarted":
            self.started += 1
            return {"type": "speech_started", "segment_id": self.started - 1, "start": message["timestamp"]}
        if kind == "Results":
            start, duration = message["start"], message["duration"]
            text = message["channel"]["alternatives"][0]["transcript"]
            if message.get("is_final"):
                self.finals += 1
                return {"type": "final", "segment_id": self.finals - 1, "text": text, "end": start + duration}
            return {"type": "partial", "segment_id": self.started - 1, "text": text, "end": start + duration}
        if kind == "Metadata":
            self.ended = True
        elif kind == "Error":
            return {"type": "error", "code": message.get("variant"), "message": message.get("description", "")}
        return None


async def run_deepgram(args, record: ClientRecord, tracks: list[np.ndarray], stop_at: float,
                       bench_start: float) -> None:
    """One Deepgram live stream: binary 24 kHz linear16 chunks, CloseStream, read until Metadata and the close."""
    import soxr

    audio = soxr.resample(tracks[0], SAMPLE_RATE, DEEPGRAM_RATE).astype(np.float32)
    url = endpoint(args.url, "deepgram")
    if args.language:
        url += ("&" if "?" in url else "?") + f"language={args.language}"
    record.pre_roll_s = VadSettings().pre_roll_ms / 1000  # the server's default: Deepgram cannot ask for another
    transcripts = DeepgramTranscripts()
    websocket = await open_websocket(url, record)
    if websocket is None:
        return

    async def receive() -> None:
        try:
            async for frame in websocket:  # until the server closes after Metadata
                arrived, message = time.perf_counter(), json.loads(frame)
                record.session_id = record.session_id or message.get("metadata", {}).get("request_id", "")
                event = transcripts.take(message)
                if event is not None:
                    record.events.append((arrived, event))
        except ConnectionClosed as closed:
            record.error = f"closed by the server: {closed}"
        record.drained = transcripts.ended
        if not record.drained:
            record.error = record.error or "closed by the server before Metadata"

    receiving = asyncio.ensure_future(receive())
    try:
        await send_paced(websocket, record, audio, DEEPGRAM_RATE, lambda pcm: pcm, args, stop_at, bench_start, receiving)
        if not receiving.done():
            await websocket.send(DEEPGRAM_CLOSE)
        await _drain(receiving, args.drain_timeout_s, record)
    except ConnectionClosed as closed:
        record.error = record.error or f"closed by the server: {closed}"
    finally:
        receiving.cancel()
        await websocket.close()
        record.close_code = websocket.close_code


# ---- Twilio Media Streams ----------------------------------------------------------------------------------------


class TwilioCall:
    """The messages Twilio sends for one call with one or two tracks (float32 8 kHz, the same length): builders
    only, numbered as Twilio numbers them (`sequenceNumber` from 1 after `connected`, `chunk` per track from 1)."""

    def __init__(self, tracks: list[np.ndarray], *, call_sid: str | None = None, parameters: dict | None = None):
        if not 1 <= len(tracks) <= 2:
            raise ValueError(f"a Twilio stream has one or two tracks, got {len(tracks)}")
        self.tracks = tracks
        self.call_sid = call_sid or "CA" + uuid.uuid4().hex
        self.stream_sid = "MZ" + uuid.uuid4().hex
        self.parameters = parameters or {}  # <Parameter>s of the TwiML
        self.num_frames = -(-len(tracks[0]) // TWILIO_FRAME)
        self._sequence = 0

    def _next(self) -> str:
        self._sequence += 1
        return str(self._sequence)

    def connected(self) -> str:
        return json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"})

    def start(self) -> str:
        return json.dumps({"event": "start", "sequenceNumber": self._next(), "streamSid": self.stream_sid,
                           "start": {"streamSid": self.stream_sid, "accountSid": "AC" + "0" * 32,
                                     "callSid": self.call_sid, "tracks": list(TWILIO_TRACKS[:len(self.tracks)]),
                                     "customParameters": self.parameters,
                                     "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": TWILIO_RATE,
                                                     "channels": 1}}})

    def media(self, frame: int) -> list[str]:
        """Frame `frame` (0-based, 20 ms) of every track."""
        begin = frame * TWILIO_FRAME
        return [json.dumps({"event": "media", "sequenceNumber": self._next(), "streamSid": self.stream_sid,
                            "media": {"track": name, "chunk": str(frame + 1), "timestamp": str(frame * 20),
                                      "payload": base64.b64encode(g711.encode(audio[begin:begin + TWILIO_FRAME],
                                                                                  "mulaw")).decode()}})
                for name, audio in zip(TWILIO_TRACKS, self.tracks)]

    def stop(self) -> str:
        return json.dumps({"event": "stop", "sequenceNumber": self._next(), "streamSid": self.stream_sid,
                           "stop": {"accountSid": "AC" + "0" * 32, "callSid": self.call_sid}})


def subscriber_url(url: str, call_id: str) -> str:
    parts = urlsplit(endpoint(url, "twilio"))
    return urlunsplit((parts.scheme, parts.netloc, f"/v1/calls/{call_id}/events", "", ""))


async def run_twilio(args, record: ClientRecord, tracks: list[np.ndarray], stop_at: float,
                     bench_start: float) -> None:
    """One Twilio call; its transcripts from the call's subscriber stream."""
    import soxr

    call = TwilioCall([soxr.resample(track, SAMPLE_RATE, TWILIO_RATE).astype(np.float32) for track in tracks],
                      parameters={"qasr_language": args.language} if args.language else None)
    record.session_id = call.call_sid
    record.pre_roll_s = VadSettings().pre_roll_ms / 1000  # the server's default: a call cannot ask for another
    frames_per_tick = max(1, round(args.chunk_ms / 20))
    try:
        subscriber = await connect(subscriber_url(args.url, call.call_sid), open_timeout=OPEN_TIMEOUT_S,
                                   max_size=None, compression=None)
    except (OSError, InvalidHandshake, asyncio.TimeoutError) as error:
        record.error = f"subscriber: {type(error).__name__}: {error}"
        return

    async def receive() -> None:
        try:
            async for frame in subscriber:  # until the server closes it after call_ended
                arrived, message = time.perf_counter(), json.loads(frame)
                if message.get("type") in ("speech_started", "partial", "final", "error"):
                    record.events.append((arrived, message))
                elif message.get("type") == "call_ended":
                    record.drained = True
        except ConnectionClosed as closed:
            record.error = f"subscriber closed: {closed}"

    receiving = asyncio.ensure_future(receive())
    media = None
    try:
        media = await connect(endpoint(args.url, "twilio"), open_timeout=OPEN_TIMEOUT_S, max_size=None,
                              compression=None)
        await media.send(call.connected())
        await media.send(call.start())
        async for k in paced(record, -(-call.num_frames // frames_per_tick),
                             frames_per_tick * TWILIO_FRAME / TWILIO_RATE / args.speed, stop_at=stop_at,
                             bench_start=bench_start, done=receiving):
            for frame in range(k * frames_per_tick, min((k + 1) * frames_per_tick, call.num_frames)):
                for message in call.media(frame):
                    await media.send(message)
                record.audio_seconds += TWILIO_FRAME / TWILIO_RATE
        await media.send(call.stop())
        await _drain(receiving, args.drain_timeout_s, record)
        try:  # the server closes the media socket once the call's finals are out
            await asyncio.wait_for(media.wait_closed(), MEDIA_CLOSE_TIMEOUT_S)
        except asyncio.TimeoutError:
            record.error = record.error or f"the media stream was still open {MEDIA_CLOSE_TIMEOUT_S:g} s after stop"
    except (OSError, InvalidHandshake, asyncio.TimeoutError, ConnectionClosed) as error:
        record.error = record.error or f"{type(error).__name__}: {error}"
    finally:
        receiving.cancel()
        if media is not None:
            await media.close()
            record.close_code = media.close_code
        await subscriber.close()


CLIENTS: dict[str, Callable] = {"native": run_native, "openai": run_openai, "deepgram": run_deepgram,
                                 "twilio": run_twilio}
