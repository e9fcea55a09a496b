"""The drop-in APIs end to end with the vendors' own unmodified SDKs (`openai` and `deepgram-sdk`, pinned in the test
extra) against a server on the tiny random model (CPU): espeak utterances with known pauses, streamed in real
time (faster where no partial is awaited).

The random model's words are noise, so what is checked is the protocol: one completed item / one final result per
utterance, deltas / interim results before it, times within TOLERANCE_S of the true speech, the close, the errors
each protocol answers bad client messages with (a misbehaving session beside a good one on the same server), the
handshakes refused with HTTP 400 (a Deepgram encoding qasr cannot take, an OpenAI session that is not for
transcription) and 401 (a wrong key) before the WebSocket opens.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib

import numpy as np
import pytest
import soundfile
import soxr
from deepgram import AsyncDeepgramClient
from deepgram.core.api_error import ApiError
from deepgram.environment import DeepgramClientEnvironment
from deepgram.listen.v1.types import ListenV1Configure, ListenV1Finalize
from openai import AsyncOpenAI

from qasr.engine.engine import AsyncEngine, Engine, EngineOptions
from qasr.model.checkpoint import load_model
from qasr.model.tokenizer import Tokenizer
from qasr.server.app import QasrServer, ServerConfig
from qasr.server.auth import ApiKey, Authenticator, KeyStore, digest
from qasr.server.security import SecuritySettings
from qasr.streaming.settings import StreamSettings, VadSettings

# tests/ is on sys.path (tests/conftest.py)
from live_server import spoken_wav

SENTENCES = ["Please call me back tomorrow.", "The quick brown fox jumps over the lazy dog."]  # the longer one
# second: its partials have time while the first one's final is decoded
RIGHT_SENTENCE = ["Seven hundred and twelve."]  # the other speaker of the stereo file
TOLERANCE_S = 0.15  # segment boundaries vs the true speech (pre-roll 0)
SPEED = 2.0  # times real time: still room for a partial of every utterance on a busy machine
OPTIONS = EngineOptions(num_slots=8, max_len=1024, num_retained=16, tokens_per_second=4.0)  # a small decode budget
DEFAULTS = StreamSettings(partial_interval_ms=300, vad=VadSettings(pre_roll_ms=0))  # the server's stream defaults
KEY = "sk-qasr-test-key"


def run(coroutine, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load_model(tiny_model_dir, device="cpu", dtype="float32"), Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Two utterances 1.2 s apart, 16 kHz float32, and their true (start, end) seconds."""
    path = tmp_path_factory.mktemp("speech") / "speech.wav"
    truth = spoken_wav(path, SENTENCES, lead_s=0.5, pause_s=1.2, tail_s=1.2)
    return soundfile.read(str(path), dtype="float32")[0], truth


@pytest.fixture(scope="module")
def stereo(speech, tmp_path_factory) -> tuple[np.ndarray, list[list[tuple[float, float]]]]:
    """[frames, 2]: the two utterances on the left; one other utterance on the right, overlapping them."""
    left, left_truth = speech
    path = tmp_path_factory.mktemp("speech") / "right.wav"
    right_truth = spoken_wav(path, RIGHT_SENTENCE, lead_s=2.2, tail_s=1.2)
    right = soundfile.read(str(path), dtype="float32")[0]
    right = np.pad(right, (0, max(0, len(left) - len(right))))[:len(left)]
    return np.stack([left, right], axis=1), [left_truth, right_truth]


@contextlib.asynccontextmanager
async def serving(model_and_tokenizer, *, security: SecuritySettings | None = None):
    model, tokenizer = model_and_tokenizer
    engine = AsyncEngine(Engine(model, tokenizer, OPTIONS, name="tiny"))
    await engine.start()
    config = ServerConfig(port=0, ping_interval_s=None, defaults=DEFAULTS,
                          **({"security": security} if security is not None else {}))
    server = QasrServer(engine, config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def s16le(samples: np.ndarray, rate: int, to_rate: int) -> bytes:
    if rate != to_rate:
        samples = soxr.resample(samples, rate, to_rate)
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


async def paced(chunks: list[bytes], seconds_per_chunk: float, send, speed: float = SPEED) -> None:
    for chunk in chunks:
        await send(chunk)
        await asyncio.sleep(seconds_per_chunk / speed)


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[offset:offset + size] for offset in range(0, len(data), size)]


# -- OpenAI Realtime -------------------------------------------------------------------------------------------------


def openai_client(server: QasrServer, api_key: str = KEY) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=api_key)


def transcription_session(turn_detection) -> dict:
    return {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 24000},
        "transcription": {"model": "gpt-4o-transcribe", "language": "en", "prompt": "A test."},
        "turn_detection": turn_detection}}}}


async def append_all(connection, pcm: bytes) -> None:
    async def append(chunk: bytes) -> None:
        await connection.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})

    await paced(pieces(pcm, 4800), 0.1, append)  # 100 ms of 24 kHz s16le per append


async def events_until_completed(connection, count: int) -> list:
    events = []
    async for event in connection:
        events.append(event)
        if sum(event.type.startswith("conversation.item.input_audio_transcription.") and
               not event.type.endswith(".delta") for event in events) == count:
            return events
    raise AssertionError(f"the connection closed before {count} items completed: {events}")


def of_type(events: list, kind: str) -> list:
    return [event for event in events if event.type == kind]


def assert_items(events: list, count: int) -> list:
    """`count` items: each committed once, chained, with deltas before its one completed transcript."""
    committed = of_type(events, "input_audio_buffer.committed")
    completed = of_type(events, "conversation.item.input_audio_transcription.completed")
    assert len(committed) == len(completed) == count and not of_type(events, "error")
    assert [item.previous_item_id for item in committed] == [None] + [item.item_id for item in committed[:-1]]
    assert [item.item_id for item in completed] == [item.item_id for item in committed]
    for item in completed:
        deltas = [event for event in of_type(events, "conversation.item.input_audio_transcription.delta")
                  if event.item_id == item.item_id]
        assert deltas and all(events.index(delta) < events.index(item) for delta in deltas)
        assert item.transcript and item.usage.type == "duration" and item.usage.seconds > 0.5
    assert len({event.event_id for event in events}) == len(events)  # every server event has its own id
    return completed


def test_openai_server_vad_gives_one_completed_item_per_utterance(model_and_tokenizer, speech):
    audio, truth = speech
    pcm = s16le(audio, 16000, 24000)

    async def main():
        async with serving(model_and_tokenizer) as server:
            async with openai_client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
                await connection.send(transcription_session({"type": "server_vad", "prefix_padding_ms": 0,
                                                             "silence_duration_ms": 500}))
                sending = asyncio.create_task(append_all(connection, pcm))
                events = await events_until_completed(connection, len(truth))
                await sending
            await until(lambda: not server.connections)  # the client's close ended the stream
            return events

    events = run(main())
    assert [event.type for event in events[:2]] == ["session.created", "session.updated"]
    assert events[1].session.audio.input.transcription.language == "en"
    completed = assert_items(events, len(truth))
    started = of_type(events, "input_audio_buffer.speech_started")
    stopped = of_type(events, "input_audio_buffer.speech_stopped")
    assert [event.item_id for event in started] == [event.item_id for event in stopped] == \
        [item.item_id for item in completed]
    for start, stop, (true_start, true_end) in zip(started, stopped, truth):
        assert isinstance(start.audio_start_ms, int) and isinstance(stop.audio_end_ms, int)
        assert abs(start.audio_start_ms / 1000 - true_start) < TOLERANCE_S
        assert abs(stop.audio_end_ms / 1000 - true_end) < TOLERANCE_S
        assert events.index(start) < events.index(stop)


def test_openai_manual_turns_end_at_each_commit(model_and_tokenizer, speech):
    audio, truth = speech
    middle = int((truth[0][1] + truth[1][0]) / 2 * 16000)  # in the pause between the utterances
    turns = [s16le(audio[:middle], 16000, 24000), s16le(audio[middle:], 16000, 24000)]

    async def main():
        async with serving(model_and_tokenizer) as server:
            async with openai_client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
                await connection.send(transcription_session(None))
                await connection.send({"type": "input_audio_buffer.commit", "event_id": "commit-0"})  # nothing yet
                for turn in turns:
                    await append_all(connection, turn)
                    await connection.send({"type": "input_audio_buffer.commit"})
                return await events_until_completed(connection, len(turns))

    events = run(main())
    [error] = of_type(events, "error")  # the empty commit, as the real service answers it
    assert error.error.code == "input_audio_buffer_commit_empty" and error.error.event_id == "commit-0"
    events.remove(error)
    assert_items(events, len(turns))
    assert not of_type(events, "input_audio_buffer.speech_started")  # no server VAD events without turn detection
    assert events[1].session.audio.input.turn_detection is None


# -- Deepgram ----------------------------------------------------------------------------------------------------------


def deepgram_client(server: QasrServer, api_key: str = KEY) -> AsyncDeepgramClient:
    http, ws = f"http://127.0.0.1:{server.port}", f"ws://127.0.0.1:{server.port}"
    return AsyncDeepgramClient(api_key=api_key, environment=DeepgramClientEnvironment(
        base=http, production=ws, agent=ws, agent_rest=http))


async def read_messages(socket) -> list:
    return [message async for message in socket]


def results(messages: list, *, final: bool | None = None, channel: int | None = None) -> list:
    return [message for message in messages if message.type == "Results"
            and (final is None or message.is_final is final)
            and (channel is None or message.channel_index[0] == channel)]


def test_deepgram_interim_results_then_one_final_per_utterance(model_and_tokenizer, speech):
    audio, truth = speech

    async def main():
        async with serving(model_and_tokenizer) as server:
            async with deepgram_client(server).listen.v1.connect(
                    model="nova-3", encoding="linear16", sample_rate=16000, interim_results="true",
                    vad_events="true", utterance_end_ms="1000", punctuate="true", smart_format="true") as socket:
                reading = asyncio.create_task(read_messages(socket))
                await paced(pieces(s16le(audio, 16000, 16000), 3200), 0.1, socket.send_media)
                await socket.send_keep_alive()
                await socket.send_close_stream()
                messages = await reading
                return messages, socket._websocket.close_code

    messages, close_code = run(main())
    assert close_code == 1000
    finals = results(messages, final=True)
    assert len(finals) == len(truth) and messages[-1].type == "Metadata"
    assert messages[-1].channels == 1 and messages[-1].duration == pytest.approx(len(audio) / 16000, abs=0.01)
    for final, (start, end) in zip(finals, truth):
        assert abs(final.start - start) < TOLERANCE_S and abs(final.start + final.duration - end) < TOLERANCE_S
        assert final.speech_final and not final.from_finalize and final.channel_index == [0, 1]
        alternative = final.channel.alternatives[0]
        assert alternative.transcript and alternative.words and alternative.confidence == 1.0
        assert final.metadata.model_info.name == "nova-3"
        interims = [message for message in results(messages, final=False) if message.start == final.start]
        assert interims and messages.index(interims[-1]) < messages.index(final)
    assert len([message for message in messages if message.type == "SpeechStarted"]) == len(truth)
    assert len([message for message in messages if message.type == "UtteranceEnd"]) == len(truth)


def test_deepgram_without_interim_results_and_finalize(model_and_tokenizer, speech):
    audio, truth = speech
    second_half = int((truth[1][0] + truth[1][1]) / 2 * 16000)  # in the middle of the second utterance

    async def main():
        async with serving(model_and_tokenizer) as server:
            async with deepgram_client(server).listen.v1.connect(model="nova-3", encoding="linear16",
                                                                 sample_rate=16000) as socket:
                reading = asyncio.create_task(read_messages(socket))
                await paced(pieces(s16le(audio[:second_half], 16000, 16000), 3200), 0.1, socket.send_media,
                            speed=4.0)  # no partials to wait for
                await socket.send_finalize()
                await socket.send_close_stream()
                return await reading

    messages = run(main())
    assert not results(messages, final=False)  # no partials were even decoded
    first, finalized = results(messages, final=True)
    assert not first.from_finalize and abs(first.start - truth[0][0]) < TOLERANCE_S
    assert finalized.from_finalize and finalized.speech_final
    assert abs(finalized.start - truth[1][0]) < TOLERANCE_S
    assert finalized.start + finalized.duration == pytest.approx(second_half / 16000, abs=0.05)
    assert messages[-1].type == "Metadata"


def test_deepgram_multichannel_gives_each_channel_its_own_results(model_and_tokenizer, stereo):
    audio, truth = stereo

    async def main():
        async with serving(model_and_tokenizer) as server:
            async with deepgram_client(server).listen.v1.connect(
                    model="nova-3", encoding="linear16", sample_rate=16000, channels=2, multichannel="true",
                    interim_results="true") as socket:
                reading = asyncio.create_task(read_messages(socket))
                await paced(pieces(s16le(audio.reshape(-1), 16000, 16000), 6400), 0.1, socket.send_media)
                await socket.send_finalize(ListenV1Finalize(type="Finalize", channel=1))
                await socket.send_close_stream()
                return await reading

    messages = run(main())
    for channel in (0, 1):
        finals = results(messages, final=True, channel=channel)
        assert len(finals) == len(truth[channel])
        for final, (start, end) in zip(finals, truth[channel]):
            assert final.channel_index == [channel, 2]
            assert abs(final.start - start) < TOLERANCE_S and abs(final.start + final.duration - end) < TOLERANCE_S
        assert results(messages, final=False, channel=channel)
    assert messages[-1].type == "Metadata" and messages[-1].channels == 2


# -- errors, isolation, handshakes -------------------------------------------------------------------------------------


def test_bad_messages_get_each_protocols_errors_while_a_good_session_streams_on(model_and_tokenizer, speech):
    audio, truth = speech
    pcm = s16le(audio, 16000, 24000)

    async def good_openai(server) -> list:
        async with openai_client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
            await connection.send(transcription_session({"type": "server_vad", "prefix_padding_ms": 0}))
            sending = asyncio.create_task(append_all(connection, pcm))
            events = await events_until_completed(connection, len(truth))
            await sending
            return events

    async def bad_openai(server) -> list:
        async with openai_client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
            await connection.send_raw("this is not JSON")
            await connection.send({"type": "response.create", "event_id": "evt-1"})
            await connection.send({"type": "input_audio_buffer.commit", "event_id": "evt-2"})
            await connection.send_raw('{"type": "session.update", "session": {"type": "transcription", "audio": '
                                      '{"input": {"format": {"type": "audio/flac"}}}}, "event_id": "evt-3"}')
            await connection.send_raw('{"type": "input_audio_buffer.append", "audio": "***", "event_id": "evt-4"}')
            await connection.send_raw('{"type": "session.update", "session": {"type": "realtime"}}')
            silence = base64.b64encode(bytes(4800)).decode()  # 100 ms: the stream starts
            await connection.send({"type": "input_audio_buffer.append", "audio": silence})
            await connection.send({"type": "session.update", "event_id": "evt-5", "session": {  # too late now
                "type": "transcription", "audio": {"input": {"format": {"type": "audio/pcmu"}}}}})
            errors = []
            async for event in connection:
                if event.type == "error":
                    errors.append(event.error)
                if len(errors) == 7:
                    return errors
            raise AssertionError("the connection closed")

    async def bad_deepgram(server) -> tuple[list, int]:
        async with deepgram_client(server).listen.v1.connect(model="nova-3", encoding="linear16",
                                                             sample_rate=16000) as socket:
            reading = asyncio.create_task(read_messages(socket))
            await socket._websocket.send("not JSON")  # the SDK sends only well-formed messages: go around it
            await socket._websocket.send('{"type": "Shout"}')
            await socket.send_finalize(ListenV1Finalize(type="Finalize", channel=3))
            await socket.send_configure(ListenV1Configure(type="Configure", keyterms=["qasr"]))
            await socket.send_media(s16le(audio[:8000], 16000, 16000))  # the stream still takes audio (the lead
            await socket.send_close_stream()  # silence: no segment)
            return await reading, socket._websocket.close_code

    async def main():
        async with serving(model_and_tokenizer) as server:
            return await asyncio.gather(good_openai(server), bad_openai(server), bad_deepgram(server))

    good, openai_errors, (deepgram_messages, deepgram_close) = run(main())
    assert_items(good, len(truth))
    assert [(error.type, error.code, error.param, error.event_id) for error in openai_errors] == [
        ("invalid_request_error", "invalid_json", None, None),
        ("invalid_request_error", "invalid_event", "type", "evt-1"),
        ("invalid_request_error", "input_audio_buffer_commit_empty", None, "evt-2"),
        ("invalid_request_error", "invalid_value", "session.audio.input.format.type", "evt-3"),
        ("invalid_request_error", "invalid_value", "audio", "evt-4"),
        ("invalid_request_error", "invalid_value", "session.type", None),
        ("invalid_request_error", "session_already_started", "session", "evt-5")]
    assert [message.type for message in deepgram_messages] == ["Error", "Error", "Error", "ConfigureFailure",
                                                               "Metadata"]
    assert {message.variant for message in deepgram_messages[:3]} == {"SchemaError"}
    assert deepgram_close == 1000


def test_handshakes_refused_before_the_socket_opens(model_and_tokenizer):
    async def main():
        security = SecuritySettings(auth=Authenticator(KeyStore([ApiKey("ci", digest(KEY))]), required=True))
        async with serving(model_and_tokenizer, security=security) as server:
            refused = []
            with pytest.raises(ApiError) as caught:  # an encoding qasr cannot take: 400, as Deepgram answers
                async with deepgram_client(server).listen.v1.connect(model="nova-3", encoding="opus"):
                    pass
            refused.append(caught.value.status_code)
            with pytest.raises(ApiError) as caught:
                async with deepgram_client(server, api_key="wrong").listen.v1.connect(model="nova-3"):
                    pass
            refused.append(caught.value.status_code)
            for client, query in ((openai_client(server), {}), (openai_client(server, "wrong"),
                                                                {"intent": "transcription"})):
                with pytest.raises(Exception) as caught:
                    async with client.realtime.connect(extra_query=query):
                        pass
                refused.append(caught.value.response.status_code)
            async with openai_client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
                assert (await connection.recv()).type == "session.created"  # the right key
            return refused

    assert run(main()) == [400, 401, 400, 401]


async def until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"condition not met within {timeout} s"
        await asyncio.sleep(0.01)
