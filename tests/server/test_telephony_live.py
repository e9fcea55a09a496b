"""Telephony calls over real sockets on the tiny random model (CPU): each platform's frames replayed by
tests/call_replay.py, the transcripts followed by a subscriber WebSocket (`/v1/calls/{id}/events`) and a local
webhook receiver that checks every request's HMAC signature as an integrator would.

Each track is espeak-ng speech with known pauses, different per track, so every final can be held to the true
position of its utterance; the random model's words mean nothing, the segment boundaries do. Twilio replays at real
time (as the platform sends); the others faster, since the timeline comes from the samples, not the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import io
import json
import shutil
import subprocess

import numpy as np
import pytest
import soundfile
import soxr
from call_replay import FRAME, RATE, AudioHookClient, frames_of, play, telnyx_call, twilio_call, vonage_call
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from qasr.engine.engine import AsyncEngine, Engine, EngineOptions
from qasr.model.checkpoint import load_model
from qasr.model.tokenizer import Tokenizer
from qasr.server.app import QasrServer, ServerConfig
from qasr.server.audiohook import PROBE_CONVERSATION
from qasr.server.auth import Authenticator, KeyStore
from qasr.server.calls import CallOptions
from qasr.server.security import SecuritySettings
from qasr.server.webhooks import WebhookOptions
from qasr.streaming.settings import StreamSettings, VadSettings

TOLERANCE_S = 0.15  # segment boundaries vs the true speech (G.711 and 8 kHz blur the VAD's edges a little)
DTMF_TOLERANCE_S = 0.05
FAST = 8.0  # replay speed where timing does not matter
OPTIONS = EngineOptions(num_slots=8, max_len=1024, num_retained=16, tokens_per_second=4.0)
SECRET = b"webhook-signing-secret"
API_KEY = "audiohook-test-key-0123456789"
CALLER = [(0.5, "Hello I am calling about my last bill."), (1.2, "The account number is four two.")]
AGENT = [(1.1, "Thank you for calling."), (2.2, "Let me look that up for you.")]
DIGITS = [(2.0, "4"), (2.5, "2")]
WEBHOOK_TYPES = {"call_started", "final", "dtmf", "call_ended"}


def run(coroutine, timeout: float = 90):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


# ---- speech ------------------------------------------------------------------------------------------------------

def espeak(text: str) -> np.ndarray:
    """One utterance at 8 kHz, cut to its audible part."""
    wav = subprocess.run(["espeak-ng", "--stdout", text], check=True, capture_output=True).stdout
    speech, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    speech = soxr.resample(speech, rate, RATE).astype(np.float32)
    frame = RATE // 100
    energy_db = 10 * np.log10(np.mean(speech[: len(speech) // frame * frame].reshape(-1, frame) ** 2, 1) + 1e-20)
    loud = np.nonzero(energy_db > energy_db.max() - 40)[0]
    return speech[loud[0] * frame:(loud[-1] + 1) * frame]


def speak(script: list[tuple[float, str]]) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Pauses and utterances in turn -> the track and each utterance's true (start, end) seconds."""
    pieces, truth, position = [], [], 0
    for pause_s, text in script:
        utterance = espeak(text)
        pieces += [np.zeros(round(pause_s * RATE), np.float32), utterance]
        position += round(pause_s * RATE)
        truth.append((position / RATE, (position + len(utterance)) / RATE))
        position += len(utterance)
    return np.concatenate(pieces), truth


@pytest.fixture(scope="module")
def call_audio():
    """(caller, caller truth, agent, agent truth): two tracks of one length, 0.9 s of quiet after the last word."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng); CI installs it")
    caller, caller_truth = speak(CALLER)
    agent, agent_truth = speak(AGENT)
    length = max(len(caller), len(agent)) + round(0.9 * RATE)
    length += -length % FRAME
    rng = np.random.default_rng(0)
    tracks = [np.pad(track, (0, length - len(track))) + 0.002 * rng.standard_normal(length).astype(np.float32)
              for track in (caller, agent)]
    return tracks[0], caller_truth, tracks[1], agent_truth


# ---- the server, a subscriber, a webhook receiver ----------------------------------------------------------------

@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load_model(tiny_model_dir, device="cpu", dtype="float32"), Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def engine(model_and_tokenizer) -> AsyncEngine:
    model, tokenizer = model_and_tokenizer
    return AsyncEngine(Engine(model, tokenizer, OPTIONS, name="tiny"))


@contextlib.asynccontextmanager
async def telephony_server(engine, *, webhook_url: str | None = None, **config):
    """Segments start at the first voiced frame (no pre-roll): comparable to the truth."""
    await engine.start()
    server = QasrServer(engine, ServerConfig(
        port=0, ping_interval_s=None, defaults=StreamSettings(vad=VadSettings(pre_roll_ms=0)),
        calls=CallOptions(webhook_url=webhook_url), webhooks=WebhookOptions(secret=SECRET, backoff_s=0.05), **config))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class Subscriber:
    """A client of GET /v1/calls/{id}/events: every message until the server closes."""

    def __init__(self, server: QasrServer, call_id: str, headers: dict | None = None):
        self.url = f"ws://127.0.0.1:{server.port}/v1/calls/{call_id}/events"
        self.messages: list[dict] = []
        self.close_code: int | None = None
        self.task = asyncio.get_running_loop().create_task(self._follow(headers))

    async def _follow(self, headers: dict | None) -> None:
        async with connect(self.url, additional_headers=headers) as socket:
            with contextlib.suppress(ConnectionClosed):
                async for frame in socket:
                    self.messages.append(json.loads(frame))
        self.close_code = socket.close_code

    async def result(self) -> list[dict]:
        await asyncio.wait_for(self.task, 30)
        return self.messages


async def subscribed(server: QasrServer, call_id: str, headers: dict | None = None) -> Subscriber:
    """A subscriber connected (and waiting) before its call starts."""
    subscriber = Subscriber(server, call_id, headers)
    for _ in range(500):
        if any(other.call_id == call_id for other in server.subscribers):
            return subscriber
        await asyncio.sleep(0.01)
    raise AssertionError("the subscriber did not connect")


class WebhookReceiver:
    """An HTTP endpoint in the test's loop: checks X-Qasr-Signature as docs/integrations.md tells integrators to,
    keeps the messages of valid requests, answers 200."""

    def __init__(self):
        self.messages: list[dict] = []
        self.bad_signatures = 0
        self.url = ""

    async def __aenter__(self) -> "WebhookReceiver":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/hooks/calls"
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readline():  # the request line; httpx keeps the connection alive between posts
                headers = {}
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                timestamp = headers.get("x-qasr-timestamp", "")
                expected = "sha256=" + hmac.new(SECRET, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
                if hmac.compare_digest(expected, headers.get("x-qasr-signature", "")):
                    self.messages.append(json.loads(body))
                else:
                    self.bad_signatures += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def call(self, call_id: str) -> list[dict]:
        """The call's messages once its call_ended arrived."""
        for _ in range(1000):
            mine = [message for message in self.messages if message["call_id"] == call_id]
            if mine and mine[-1]["type"] == "call_ended":
                return mine
            await asyncio.sleep(0.01)
        raise AssertionError(f"the webhook never got call {call_id}'s end")


async def place(server: QasrServer, path: str, frames, *, speed: float = FAST, **connect_options) -> int:
    """Play a call's frames to the server; the close code once the server closed (or the frames ended)."""
    async with connect(f"ws://127.0.0.1:{server.port}{path}", **connect_options) as socket:
        with contextlib.suppress(ConnectionClosed):  # a server that closed (1007: a malformed frame) takes no more
            await play(socket, frames, speed=speed)
        if isinstance(frames[-1][1], str) and '"stop"' in frames[-1][1]:  # the platform waits for the server's close
            with contextlib.suppress(ConnectionClosed):
                async for _ in socket:
                    pass
    return socket.close_code


# ---- assertions --------------------------------------------------------------------------------------------------

def assert_call(messages: list[dict], *, platform: str, tracks: dict, digits=DIGITS) -> None:
    """tracks: channel -> (track name, speaker, truth). One final per utterance, on its track, where it was said."""
    assert [message["seq"] for message in messages] == list(range(1, len(messages) + 1))
    assert messages[0]["type"] == "call_started" and messages[0]["platform"] == platform
    assert [(t["channel"], t["track"], t["speaker"]) for t in messages[0]["tracks"]] == \
        [(channel, name, speaker) for channel, (name, speaker, _) in sorted(tracks.items())]
    assert messages[-1]["type"] == "call_ended"
    assert not [message for message in messages if message["type"] == "error"]
    finals = [message for message in messages if message["type"] == "final"]
    for channel, (name, speaker, truth) in tracks.items():
        mine = [final for final in finals if final["channel"] == channel]
        assert all((final["track"], final["speaker"]) == (name, speaker) for final in mine)
        assert len({final["segment_id"] for final in mine}) == len(mine)  # exactly one final per segment
        assert len(mine) == len(truth), [(final["start"], final["end"]) for final in mine]
        for final, (start, end) in zip(mine, truth):
            assert abs(final["start"] - start) <= TOLERANCE_S and abs(final["end"] - end) <= TOLERANCE_S, \
                (channel, final, start, end)
    dtmf = [message for message in messages if message["type"] == "dtmf"]
    assert [message["digit"] for message in dtmf] == [digit for _, digit in digits]
    for message, (at, _) in zip(dtmf, digits):
        assert abs(message["time"] - at) <= DTMF_TOLERANCE_S and message["speaker"] == tracks[0][1]
    summary = messages[-1]["summary"]
    assert summary["dtmf"] == "".join(digit for _, digit in digits)
    assert {entry["channel"]: entry["segments"] for entry in summary["tracks"]} == \
        {channel: len(truth) for channel, (_, _, truth) in tracks.items()}


def webhook_view(messages: list[dict]) -> list[dict]:
    return [message for message in messages if message["type"] in WEBHOOK_TYPES]


# ---- the media-stream family -------------------------------------------------------------------------------------

def test_twilio_both_tracks_at_real_time_to_a_subscriber_and_a_signed_webhook(engine, call_audio):
    caller, caller_truth, agent, agent_truth = call_audio
    frames = twilio_call(caller, agent, call_sid="CA-live-1", dtmf=DIGITS)

    async def main():
        async with WebhookReceiver() as receiver, telephony_server(engine, webhook_url=receiver.url) as server:
            subscriber = await subscribed(server, "CA-live-1")
            close_code = await place(server, "/v1/twilio", frames, speed=1.0)
            live = await subscriber.result()
            late = Subscriber(server, "CA-live-1")  # after the end: the replay, partials left out
            replayed = await late.result()
            return close_code, live, subscriber.close_code, replayed, late.close_code, await receiver.call(
                "CA-live-1"), receiver.bad_signatures

    close_code, live, live_close, replayed, late_close, hooked, bad_signatures = run(main())
    assert close_code == 1000 and live_close == 1000 and late_close == 1000
    tracks = {0: ("inbound", "caller", caller_truth), 1: ("outbound", "agent", agent_truth)}
    assert_call(live, platform="twilio", tracks=tracks)
    assert any(message["type"] == "partial" for message in live)  # hypotheses while the utterances went on
    assert live[-1]["reason"] == "stop"
    assert replayed == [message for message in live if message["type"] != "partial"]
    assert hooked == webhook_view(live) and bad_signatures == 0


def test_telnyx_frames_out_of_order_are_put_back_in_order(engine, call_audio):
    caller, caller_truth, agent, agent_truth = call_audio
    frames = telnyx_call(caller, agent, call_control_id="v3:live-2", encoding="PCMA", dtmf=DIGITS, shuffle_seed=3)
    sequence_numbers = [int(json.loads(frame).get("sequence_number", 0)) for _, frame in frames]
    assert sequence_numbers != sorted(sequence_numbers)  # the replay really is out of order

    async def main():
        async with WebhookReceiver() as receiver, telephony_server(engine, webhook_url=receiver.url) as server:
            subscriber = await subscribed(server, "v3:live-2")
            close_code = await place(server, "/v1/telnyx", frames)
            return close_code, await subscriber.result(), await receiver.call("v3:live-2")

    close_code, messages, hooked = run(main())
    assert close_code == 1000
    assert_call(messages, platform="telnyx",
                tracks={0: ("inbound", "caller", caller_truth), 1: ("outbound", "agent", agent_truth)})
    assert hooked == webhook_view(messages)


def test_vonage_mono_call_ends_with_the_socket_and_still_gets_its_last_final(engine, call_audio):
    """Vonage never says `stop`: it closes the socket 0.2 s after the last word, before the VAD could close that
    segment; the call still gets the final (finalise on disconnect) and then its end."""
    caller, caller_truth, _, _ = call_audio
    cut = round((caller_truth[-1][1] + 0.2) * RATE)
    frames = vonage_call(caller[:cut], rate=RATE, call_id="conv-live-3", dtmf=DIGITS)

    async def main():
        async with WebhookReceiver() as receiver, telephony_server(engine, webhook_url=receiver.url) as server:
            subscriber = await subscribed(server, "conv-live-3")
            await place(server, "/v1/vonage?call_id=conv-live-3", frames)
            return await subscriber.result(), await receiver.call("conv-live-3")

    messages, hooked = run(main())
    assert_call(messages, platform="vonage", tracks={0: ("conversation", None, caller_truth)})
    assert messages[-1]["reason"] == "hangup"
    assert hooked == webhook_view(messages)


def test_one_malformed_call_never_affects_another_at_the_same_time(engine, call_audio):
    caller, caller_truth, agent, agent_truth = call_audio
    good = twilio_call(caller, agent, call_sid="CA-good", stream_sid="MZ-good", dtmf=DIGITS)
    bad = twilio_call(caller, agent, call_sid="CA-bad", stream_sid="MZ-bad")
    broken_at = next(index for index, (at, _) in enumerate(bad) if at >= 1.5)
    broken = json.loads(bad[broken_at][1])
    broken["media"]["payload"] = "not base64!"
    bad = bad[:broken_at] + [(bad[broken_at][0], json.dumps(broken))] + bad[broken_at + 1:]

    async def main():
        async with telephony_server(engine) as server:
            good_subscriber = await subscribed(server, "CA-good")
            bad_subscriber = await subscribed(server, "CA-bad")
            codes = await asyncio.gather(place(server, "/v1/twilio", good), place(server, "/v1/twilio", bad))
            return codes, await good_subscriber.result(), await bad_subscriber.result()

    (good_code, bad_code), good_messages, bad_messages = run(main())
    assert (good_code, bad_code) == (1000, 1007)
    assert_call(good_messages, platform="twilio",
                tracks={0: ("inbound", "caller", caller_truth), 1: ("outbound", "agent", agent_truth)})
    assert bad_messages[0]["type"] == "call_started" and bad_messages[-1]["type"] == "call_ended"
    assert bad_messages[-1]["reason"] == "disconnected"
    assert all(final["end"] <= 1.5 + TOLERANCE_S for final in bad_messages if final["type"] == "final")


# ---- Genesys AudioHook -------------------------------------------------------------------------------------------

class AudioHookSocket:
    """An AudioHook client over a real socket: sends what AudioHookClient builds, keeps every server message."""

    def __init__(self, socket, client: AudioHookClient):
        self.socket = socket
        self.client = client
        self.received: list[dict] = []
        self._arrived = asyncio.Event()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in self.socket:
                self.received.append(self.client.saw(frame))
                self._arrived.set()
        self._arrived.set()

    async def wait_for(self, kind: str) -> dict:
        while True:
            found = [message for message in self.received if message["type"] == kind]
            if found:
                return found[-1]
            if self._reader.done():
                raise AssertionError(f"the server closed without sending {kind}: {self.received}")
            self._arrived.clear()
            await asyncio.wait_for(self._arrived.wait(), 30)

    async def closed(self) -> int:
        await asyncio.wait_for(self._reader, 30)
        return self.socket.close_code


def test_audiohook_lifecycle_over_a_socket_with_transcripts_as_events(engine, call_audio):
    caller, caller_truth, agent, agent_truth = call_audio
    client = AudioHookClient()
    headers = {**client.headers, "X-API-KEY": API_KEY}
    auth = Authenticator(KeyStore.load(None, API_KEY), required=True)

    async def main():
        async with telephony_server(engine, security=SecuritySettings(auth=auth)) as server:
            subscriber = await subscribed(server, client.conversation_id, {"Authorization": f"Bearer {API_KEY}"})
            async with connect(f"ws://127.0.0.1:{server.port}/v1/audiohook", additional_headers=headers) as socket:
                hook = AudioHookSocket(socket, client)
                await socket.send(client.open())
                opened = await hook.wait_for("opened")
                for index, (start, chunk) in enumerate(frames_of(caller)):
                    if index == 100:  # 2 s in: ping, then a language update
                        await socket.send(client.message("ping"))
                        await hook.wait_for("pong")
                        await socket.send(client.message("update", {"language": "en-US"}))
                        await hook.wait_for("updated")
                    await socket.send(client.audio(chunk, agent[start:start + FRAME]))
                    if index % 25 == 0:
                        await asyncio.sleep(0)  # let the server read
                await socket.send(client.message("paused"))
                await socket.send(client.message("resumed"))
                await socket.send(client.message("close", {"reason": "end"}))
                await hook.wait_for("closed")
                close_code = await hook.closed()
            return opened, hook.received, close_code, await subscriber.result()

    opened, received, close_code, messages = run(main())
    assert opened["parameters"]["media"] == [{"type": "audio", "format": "PCMU", "channels": ["external", "internal"],
                                              "rate": 8000}]
    assert [message["seq"] for message in received] == list(range(1, len(received) + 1))
    assert received[-1]["type"] == "closed" and close_code == 1000
    assert_call(messages, platform="audiohook", digits=[],
                tracks={0: ("external", "caller", caller_truth), 1: ("internal", "agent", agent_truth)})
    transcripts = [entity["data"] for message in received if message["type"] == "event"
                   for entity in message["parameters"]["entities"]]
    finals = [message for message in messages if message["type"] == "final" and message["text"].strip()]
    assert finals  # the random model says something
    shown = [data for data in transcripts if data["isFinal"]]
    assert [(data["channelId"], data["alternatives"][0]["interpretations"][0]["transcript"]) for data in shown] == \
        [(final["channel"], final["text"]) for final in finals]
    for data, final in zip(shown, finals):
        assert float(data["offset"][2:-1]) == pytest.approx(final["start"], abs=1e-3)


def test_audiohook_probe_wrong_key_and_sequence_violation(engine, call_audio):
    caller, _, agent, _ = call_audio
    auth = Authenticator(KeyStore.load(None, API_KEY), required=True)

    async def main():
        async with telephony_server(engine, security=SecuritySettings(auth=auth)) as server:
            url = f"ws://127.0.0.1:{server.port}/v1/audiohook"
            probe = AudioHookClient(conversation_id=PROBE_CONVERSATION)
            async with connect(url, additional_headers={**probe.headers, "X-API-KEY": API_KEY}) as socket:
                hook = AudioHookSocket(socket, probe)
                await socket.send(probe.open())
                await hook.wait_for("opened")
                for start, chunk in list(frames_of(caller))[:50]:
                    await socket.send(probe.audio(chunk, agent[start:start + FRAME]))
                await socket.send(probe.message("close", {"reason": "end"}))
                await hook.wait_for("closed")
                probe_result = hook.received, await hook.closed(), server.calls.get(PROBE_CONVERSATION)

            stranger = AudioHookClient()
            with pytest.raises(InvalidStatus) as refused:
                await connect(url, additional_headers={**stranger.headers, "X-API-KEY": "not-a-key-0123456789"})

            client = AudioHookClient()
            async with connect(url, additional_headers={**client.headers, "X-API-KEY": API_KEY}) as socket:
                hook = AudioHookSocket(socket, client)
                await socket.send(client.open())
                await hook.wait_for("opened")
                client.seq += 1  # a message lost: the next seq skips one
                await socket.send(client.message("ping"))
                disconnect = await hook.wait_for("disconnect")
                violation = disconnect, await hook.closed()
            return probe_result, refused.value.response.status_code, violation

    (probe_received, probe_close, probe_call), status, (disconnect, violation_close) = run(main())
    assert [message["type"] for message in probe_received] == ["opened", "closed"]  # no transcripts
    assert probe_close == 1000 and probe_call is None  # nothing published for the probe
    assert status == 401
    assert disconnect["parameters"]["reason"] == "error"
    assert disconnect["parameters"]["info"].startswith("Client Error: Invalid seq")
    assert violation_close == 1007
