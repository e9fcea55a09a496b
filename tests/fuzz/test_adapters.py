"""Property-based fuzzing of every wire adapter, sans-I/O: generated sequences of valid, near-valid (one field
dropped or replaced) and garbage messages, text and binary, in any order, fed as a connection would feed them.

What must hold for every message until the connection would close (a ProtocolError, or End):
- `receive` returns commands of the seam (Start, Audio, Flush, End, Notice, Reply) or raises one of the adapter's
  documented ProtocolErrors; nothing else escapes (adapters documented as never raising must not raise at all);
- Audio is float32 [frames, channels] of finite samples in [-1, 1]; Reply frames are str or bytes;
- a text frame that is not JSON gets the protocol's error (a ProtocolError close, a Notice, or an error reply);
- the error event the connection sends for a Notice or a fatal error encodes without raising.
Profiles (tests/fuzz/conftest.py): `ci` by default, HYPOTHESIS_PROFILE=nightly for >= 100,000 sequences each.
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qasr.server.audiohook import AudioHookAdapter
from qasr.server.calls import CallRegistry
from qasr.server.commands import Audio, End, Flush, Notice, Reply, Start
from qasr.server.deepgram import DeepgramAdapter
from qasr.server.errors import ProtocolError
from qasr.server.openai_realtime import OpenAIRealtimeAdapter
from qasr.server.protocol import NativeProtocol
from qasr.server.telnyx import TelnyxAdapter
from qasr.server.twilio import TwilioAdapter
from qasr.server.vonage import VonageAdapter
from qasr.streaming import events
from qasr.streaming.settings import StreamLimits, StreamSettings

COMMANDS = (Start, Audio, Flush, End, Notice, Reply)
SESSION = str(uuid.UUID(int=7))
CALL = str(uuid.UUID(int=9))

# No subnormal floats: a library loaded earlier in the test run (nagisa's DyNet, for the aligner's Japanese words) sets
# the CPU's flush-to-zero mode, and hypothesis then refuses to generate them.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40)
    | st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8)
audio_bytes = st.binary(max_size=1200)
b64_audio = audio_bytes.map(lambda data: base64.b64encode(data).decode())
not_json = st.text(max_size=40).map(lambda text: "~" + text)  # never parses as JSON


@dataclass
class Spec:
    make: Callable[[], object]
    templates: Callable[[st.DataObject, int], list[dict]]  # valid messages (n: a message counter for seq fields)
    may_raise: bool  # documented: fatal problems raise ProtocolError (close codes); else every error is a reply
    error_types: tuple[str, ...] = ()  # the "type" of the protocol's error reply
    ended: Callable[[object], bool] = lambda adapter: False  # the session is over: messages are ignored


def native(data, n):
    return [{"type": "start", **data.draw(st.fixed_dictionaries({}, optional={
        "sample_rate": st.sampled_from([8000, 16000, 44100, 48000, 7, 10**9]),
        "encoding": st.sampled_from(["s16le", "f32le", "mulaw", "alaw", "opus"]),
        "channels": st.integers(0, 9), "format": st.sampled_from(["json", "msgpack", "xml"]),
        "language": st.sampled_from([None, "auto", "English", "en", "klingon"]), "context": st.text(max_size=30),
        "partials": st.booleans(), "partial_interval_ms": st.integers(-10, 20000),
        "vad": st.fixed_dictionaries({}, optional={"aggressiveness": st.integers(-1, 4),
                                                   "end_silence_ms": st.integers(0, 9000),
                                                   "pre_roll_ms": st.integers(0, 3000),
                                                   "max_segment_s": st.floats(0, 60, allow_subnormal=False)})}))},
            {"type": "flush"}, {"type": "end"}]


def openai(data, n):
    return [{"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
                "format": {"type": data.draw(st.sampled_from(["audio/pcm", "audio/pcmu", "audio/pcma", "x"])),
                           "rate": 24000},
                "transcription": {"model": "qwen3-asr", "language": data.draw(st.sampled_from(["en", "de", "zz"]))},
                "turn_detection": data.draw(st.sampled_from([None, {"type": "server_vad"}]))}}}},
            {"type": "transcription_session.update", "session": {"input_audio_format": "pcm16"}},
            {"type": "input_audio_buffer.append", "audio": data.draw(b64_audio)},
            {"type": "input_audio_buffer.commit"}, {"type": "input_audio_buffer.clear"},
            {"type": "response.create"}]


def deepgram(data, n):
    return [{"type": "KeepAlive"}, {"type": "Finalize"}, {"type": "Finalize", "channel": data.draw(st.integers(-1, 3))},
            {"type": "CloseStream"}, {"type": "Configure", "features": {"interim_results": True}},
            {"type": "Configure", "keyterms": ["x"]}]


def twilio(data, n):
    sid = "MZ1"
    return [{"event": "connected", "protocol": "Call", "version": "1.0.0"},
            {"event": "start", "sequenceNumber": str(n), "streamSid": sid,
             "start": {"streamSid": sid, "accountSid": "AC1", "callSid": "CA1",
                       "tracks": data.draw(st.sampled_from([["inbound"], ["inbound", "outbound"], ["sideways"]])),
                       "customParameters": {"qasr_language": "en-US"},
                       "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}},
            {"event": "media", "sequenceNumber": str(n), "streamSid": sid,
             "media": {"track": data.draw(st.sampled_from(["inbound", "outbound"])), "chunk": str(n),
                       "timestamp": str(data.draw(st.integers(0, 10**6))), "payload": data.draw(b64_audio)}},
            {"event": "dtmf", "sequenceNumber": str(n), "streamSid": sid, "dtmf": {"track": "inbound_track",
                                                                                 "digit": "5"}},
            {"event": "mark", "sequenceNumber": str(n), "streamSid": sid, "mark": {"name": "m"}},
            {"event": "stop", "sequenceNumber": str(n), "streamSid": sid, "stop": {"callSid": "CA1"}}]


def telnyx(data, n):
    sid = "32de"
    return [{"event": "connected", "version": "1.0.0"},
            {"event": "start", "sequence_number": str(n), "stream_id": sid,
             "start": {"call_control_id": "v3:1", "tracks": ["inbound", "outbound"],
                       "media_format": {"encoding": data.draw(st.sampled_from(["PCMU", "PCMA", "L16", "OPUS"])),
                                        "sample_rate": data.draw(st.sampled_from([8000, 16000])), "channels": 1}}},
            {"event": "media", "sequence_number": str(n), "stream_id": sid,
             "media": {"track": "inbound", "chunk": str(n), "timestamp": str(20 * n), "payload": data.draw(b64_audio)}},
            {"event": "dtmf", "sequence_number": str(n), "stream_id": sid, "dtmf": {"digit": "1"}},
            {"event": "error", "sequence_number": str(n), "stream_id": sid, "payload": {"code": 100002, "title": "x"}},
            {"event": "stop", "sequence_number": str(n), "stream_id": sid, "stop": {"call_control_id": "v3:1"}}]


def vonage(data, n):
    return [{"event": "websocket:connected",
             "content-type": data.draw(st.sampled_from(["audio/l16;rate=16000", "audio/l16;rate=8000",
                                                        "audio/l16;rate=11025", "audio/pcmu"]))},
            {"event": "websocket:dtmf", "digit": data.draw(st.sampled_from(["5", "#", "x"])), "duration": 260}]


def audiohook(data, n):
    def message(kind, parameters):
        return {"version": "2", "id": SESSION, "type": kind, "seq": n, "serverseq": 0, "position": "PT0S",
                "parameters": parameters}

    offers = [{"type": "audio", "format": data.draw(st.sampled_from(["PCMU", "L16", "OPUS"])),
               "channels": ["external", "internal"], "rate": 8000}]
    return [message("open", {"organizationId": str(uuid.UUID(int=3)), "conversationId": CALL,
                             "participant": {"id": str(uuid.UUID(int=4)), "ani": "+1", "aniName": "a", "dnis": "+2"},
                             "media": offers, "language": "en-US"}),
            message("ping", {"rtt": "PT0.1S"}), message("update", {"language": "de-DE"}),
            message("paused", {}), message("resumed", {"start": "PT0S", "discarded": "PT0S"}),
            message("discarded", {"start": "PT0S", "discarded": "PT1S"}), message("error", {"code": 500}),
            message("close", {"reason": "end"})]


SPECS = {
    "native": Spec(lambda: NativeProtocol(), native, may_raise=True),
    "openai": Spec(lambda: OpenAIRealtimeAdapter(defaults=StreamSettings(), limits=StreamLimits(),
                                                 model_name="qwen3-asr"), openai, may_raise=False,
                   error_types=("error",)),
    "deepgram": Spec(lambda: DeepgramAdapter("encoding=linear16&sample_rate=16000&interim_results=true",
                                             defaults=StreamSettings(), limits=StreamLimits()),
                     deepgram, may_raise=False, error_types=("Error",)),
    "twilio": Spec(lambda: TwilioAdapter(defaults=StreamSettings(), limits=StreamLimits(), calls=CallRegistry()),
                   twilio, may_raise=True),
    "telnyx": Spec(lambda: TelnyxAdapter(defaults=StreamSettings(), limits=StreamLimits(), calls=CallRegistry()),
                   telnyx, may_raise=True),
    "vonage": Spec(lambda: VonageAdapter(defaults=StreamSettings(), limits=StreamLimits(), calls=CallRegistry(),
                                         query={"call_id": "v1"}), vonage, may_raise=True),
    "audiohook": Spec(lambda: AudioHookAdapter(defaults=StreamSettings(), limits=StreamLimits(), calls=CallRegistry(),
                                               headers={"Audiohook-Session-Id": SESSION, "X-API-KEY": "k"}),
                      audiohook, may_raise=True,  # a `close` before `open` is answered `closed`, without a stream
                      ended=lambda adapter: adapter.state.name in ("CLOSED", "DISCONNECTED")),
}


def mutated(data, message: dict) -> dict:
    """Near-valid: one field (at the top or one level down) dropped or given any JSON value."""
    message = json.loads(json.dumps(message))
    target = message
    nested = [key for key, value in message.items() if isinstance(value, dict) and value]
    if nested and data.draw(st.booleans()):
        target = message[data.draw(st.sampled_from(sorted(nested)))]
    key = data.draw(st.sampled_from(sorted(target)))
    if data.draw(st.booleans()):
        del target[key]
    else:
        target[key] = data.draw(json_values)
    return message


def draw_message(data, spec: Spec, n: int) -> tuple[str, str | bytes]:
    kind = data.draw(st.sampled_from(["valid", "valid", "near", "not_json", "json", "binary"]))
    if kind in ("valid", "near"):
        message = data.draw(st.sampled_from(spec.templates(data, n)))
        return kind, json.dumps(mutated(data, message) if kind == "near" else message)
    if kind == "not_json":
        return kind, data.draw(not_json)
    if kind == "json":
        return kind, json.dumps(data.draw(json_values))
    return kind, data.draw(audio_bytes)


def is_error_reply(spec: Spec, commands) -> bool:
    for command in commands:
        if isinstance(command, Notice):
            return True
        if isinstance(command, Reply):
            for frame in command.frames:
                try:
                    if json.loads(frame).get("type") in spec.error_types:
                        return True
                except (ValueError, AttributeError):
                    pass
    return False


def check_commands(adapter, commands) -> None:
    assert isinstance(commands, list)
    for command in commands:
        assert isinstance(command, COMMANDS), command
        if isinstance(command, Audio):
            samples = command.samples
            assert samples.dtype == np.float32 and samples.ndim == 2 and samples.shape[1] >= 1
            assert np.isfinite(samples).all() and np.abs(samples).max(initial=0) <= 1.0
        elif isinstance(command, Reply):
            assert all(isinstance(frame, (str, bytes)) for frame in command.frames)
        elif isinstance(command, Notice):
            check_frames(adapter.encode(events.Error(command.code, command.message)))


def check_frames(frames) -> None:
    assert isinstance(frames, list) and all(isinstance(frame, (str, bytes)) for frame in frames)


@pytest.mark.parametrize("name", sorted(SPECS))
@given(data=st.data())
def test_no_exception_escapes_an_adapter_and_bad_input_gets_its_protocols_error(name, data):
    spec = SPECS[name]
    adapter = spec.make()
    check_frames(adapter.greeting())
    for n in range(1, data.draw(st.integers(1, 24)) + 1):
        kind, message = draw_message(data, spec, n)
        ended = spec.ended(adapter)
        try:
            commands = adapter.receive(message)
        except ProtocolError as error:
            assert spec.may_raise, f"{name} must answer, not raise: {error!r}"
            check_frames(adapter.encode(events.Error(error.error_code, str(error), fatal=True)))
            break  # the connection closes with the error's code
        check_commands(adapter, commands)
        if kind == "not_json" and not ended:
            assert is_error_reply(spec, commands), f"{name} ignored a text frame that is not JSON: {message!r}"
        if any(isinstance(command, End) for command in commands):
            break  # nothing after End is read
    if hasattr(adapter, "close"):
        adapter.close()
