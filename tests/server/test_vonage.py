"""The Vonage adapter without sockets: the connected message's format and call id, binary PCM, DTMF."""

from __future__ import annotations

import json

import numpy as np
import pytest
from call_replay import vonage_call

from qasr.server.calls import CallRegistry
from qasr.server.commands import Audio, Notice, Start
from qasr.server.errors import MalformedMessage, UnsupportedFormat
from qasr.server.vonage import VonageAdapter
from qasr.streaming import events
from qasr.streaming.settings import StreamLimits, StreamSettings


def adapter(registry: CallRegistry | None = None, query: dict | None = None) -> VonageAdapter:
    return VonageAdapter(defaults=StreamSettings(), limits=StreamLimits(),
                         calls=registry if registry is not None else CallRegistry(), query=query)


def feed(vonage, frames) -> list:
    commands = []
    for _, frame in frames:
        commands += vonage.receive(frame)
    return commands


@pytest.mark.parametrize("rate", [8000, 16000, 24000])
def test_l16_at_the_connected_rate_becomes_mono_audio(rate):
    speech = (0.2 * np.sin(np.arange(rate // 5) / 5)).astype(np.float32)
    commands = feed(adapter(), vonage_call(speech, rate=rate))
    assert isinstance(commands[0], Start) and commands[0].settings.sample_rate == rate
    audio = np.concatenate([c.samples for c in commands if isinstance(c, Audio)])
    np.testing.assert_allclose(audio[:, 0], speech, atol=1e-4)


def test_the_call_id_comes_from_the_query_or_the_headers_and_the_call_ends_with_the_socket():
    registry = CallRegistry()
    vonage = adapter(registry)
    feed(vonage, vonage_call(np.zeros(1600, np.float32), call_id="conv-7", dtmf=[(0.06, "3")]))
    vonage.encode(events.Final(0, "hi", "English", 0.0, 0.1, "end", 1.0))
    vonage.close()
    messages = list(registry.get("conv-7")._replay)
    assert [m["type"] for m in messages] == ["call_started", "dtmf", "final", "call_ended"]
    assert messages[1]["time"] == 0.06 and messages[2]["speaker"] is None
    assert messages[-1]["reason"] == "hangup" and messages[-1]["summary"]["audio_seconds"] == 0.1
    from_query = adapter(registry, query={"call_id": "q-1"})
    feed(from_query, vonage_call(np.zeros(320, np.float32), call_id="ignored"))
    assert registry.get("q-1") is not None


@pytest.mark.parametrize("content_type", ["audio/l16;rate=44100", "audio/pcmu;rate=8000", "text/plain"])
def test_unsupported_content_types_are_refused(content_type):
    with pytest.raises(UnsupportedFormat, match="content-type"):
        adapter().receive(json.dumps({"event": "websocket:connected", "content-type": content_type}))


def test_protocol_violations_close_the_connection():
    with pytest.raises(MalformedMessage, match="before `websocket:connected`"):
        adapter().receive(b"\x00\x00")
    vonage = adapter()
    feed(vonage, vonage_call(np.zeros(320, np.float32)))
    with pytest.raises(MalformedMessage, match="whole samples"):
        vonage.receive(b"\x00\x00\x00")
    with pytest.raises(MalformedMessage, match="not a DTMF digit"):
        vonage.receive(json.dumps({"event": "websocket:dtmf", "digit": "55"}))
    with pytest.raises(MalformedMessage, match="once"):
        vonage.receive(json.dumps({"event": "websocket:connected", "content-type": "audio/l16;rate=16000"}))
    [notice] = vonage.receive(json.dumps({"event": "websocket:something"}))
    assert isinstance(notice, Notice) and notice.code == "unknown_event"
