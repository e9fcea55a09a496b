"""The call registry: what subscribers and webhooks receive of a call's streams, without sockets."""

from __future__ import annotations

import asyncio

import pytest

from qasr.server.calls import AGENT, CALLER, CallOptions, CallRegistry, CallsFull, Track
from qasr.streaming import events

TRACKS = (Track(0, "inbound", CALLER), Track(1, "outbound", AGENT))


class RecordingWebhooks:
    """Stands in for WebhookSender: what would be posted, where."""

    def __init__(self):
        self.posted: list[tuple[str, dict, str]] = []

    def submit(self, url, message, *, key):
        self.posted.append((url, message, key))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def final(segment_id, text, start, end):
    return events.Final(segment_id, text, "English", start, end, "silence", 12.0)


def drain(subscription) -> list[dict]:
    """What a subscription holds now, without waiting."""
    async def take():
        messages = []
        try:
            while True:
                messages.append(await asyncio.wait_for(subscription.__anext__(), 0.01))
        except (StopAsyncIteration, asyncio.TimeoutError):
            return messages
    return asyncio.run(take())


def test_a_call_reaches_a_subscriber_with_tracks_speakers_dtmf_and_one_summary():
    registry = CallRegistry()
    subscription = registry.subscribe("CA1")  # before the call starts
    stream = registry.open("CA1", platform="twilio", stream_id="MZ1", tracks=TRACKS,
                           parameters={"customer": "42"}, metadata={"account": "AC1"})
    stream.event(events.Ready("s", "m", 8000, 16000))  # the stream's own business: not a call message
    stream.event(events.SpeechStarted(0, 0.5), channel=0)
    stream.event(events.Partial(0, "hel", "English", 0.5, 1.0), channel=0)
    stream.event(final(0, "hello", 0.5, 1.5), channel=0)
    stream.dtmf("5", 2.0, channel=0)
    stream.event(final(0, "how can I help", 2.5, 4.0), channel=1)
    stream.audio(6.0, channel=0)
    stream.audio(6.0, channel=1)
    stream.event(events.Summary(1, 6.0, 1.0), channel=0)
    stream.close("stop")
    messages = drain(subscription)
    assert [m["type"] for m in messages] == ["call_started", "speech_started", "partial", "final", "dtmf", "final",
                                             "call_ended"]
    assert [m["seq"] for m in messages] == list(range(1, 8))
    assert all(m["call_id"] == "CA1" for m in messages)
    started = messages[0]
    assert started["platform"] == "twilio" and started["parameters"] == {"customer": "42"}
    assert started["tracks"] == [{"channel": 0, "track": "inbound", "speaker": "caller"},
                                 {"channel": 1, "track": "outbound", "speaker": "agent"}]
    caller_final, agent_final = messages[3], messages[5]
    assert (caller_final["text"], caller_final["speaker"], caller_final["track"]) == ("hello", "caller", "inbound")
    assert (agent_final["text"], agent_final["speaker"], agent_final["channel"]) == ("how can I help", "agent", 1)
    assert messages[4] == {"type": "dtmf", "digit": "5", "time": 2.0, "channel": 0, "track": "inbound",
                           "speaker": "caller", "stream_id": "MZ1", "call_id": "CA1", "seq": 5}
    summary = messages[-1]["summary"]
    assert summary["dtmf"] == "5" and summary["audio_seconds"] == 6.0
    assert [(t["speaker"], t["segments"], t["speech_seconds"]) for t in summary["tracks"]] == [("caller", 1, 1.0),
                                                                                               ("agent", 1, 1.5)]


def test_a_late_subscriber_gets_the_call_so_far_without_partials_then_live_messages():
    registry = CallRegistry()
    stream = registry.open("C", platform="vonage", stream_id="s", tracks=(Track(0, "mono"),))
    stream.event(events.Partial(0, "a", "English", 0, 1))
    stream.event(final(0, "a b", 0, 1.2))
    subscription = registry.subscribe("C")
    stream.event(events.Partial(1, "c", "English", 2, 3))
    messages = drain(subscription)
    assert [m["type"] for m in messages] == ["call_started", "final", "partial"]
    assert [m["seq"] for m in messages] == [1, 3, 4]  # the replayed partial (seq 2) is left out


def test_the_replay_is_bounded_and_a_seq_gap_shows_what_was_dropped():
    registry = CallRegistry(CallOptions(replay_size=3))
    stream = registry.open("C", platform="twilio", stream_id="s", tracks=(Track(0, "inbound", CALLER),))
    for n in range(5):
        stream.event(final(n, f"t{n}", n, n + 0.5))
    messages = drain(registry.subscribe("C"))
    assert [m["seq"] for m in messages] == [4, 5, 6]


def test_a_subscriber_to_an_ended_call_gets_its_record_then_the_end():
    registry = CallRegistry()
    stream = registry.open("C", platform="twilio", stream_id="s", tracks=(Track(0, "inbound", CALLER),))
    stream.close("stop")
    subscription = registry.subscribe("C")
    messages = drain(subscription)
    assert [m["type"] for m in messages] == ["call_started", "call_ended"]
    assert asyncio.run(_is_finished(subscription))


async def _is_finished(subscription) -> bool:
    try:
        await asyncio.wait_for(subscription.__anext__(), 0.1)
    except StopAsyncIteration:
        return True
    return False


def test_a_call_with_two_streams_ends_with_its_last_stream():
    registry = CallRegistry()
    subscription = registry.subscribe("CA")
    inbound = registry.open("CA", platform="twilio", stream_id="MZa", tracks=(Track(0, "inbound", CALLER),))
    outbound = registry.open("CA", platform="twilio", stream_id="MZb", tracks=(Track(0, "outbound", AGENT),))
    inbound.event(final(0, "hi", 0, 1))
    outbound.event(final(0, "hello", 0, 1))
    inbound.close()
    inbound.close()  # idempotent
    assert not registry.get("CA").ended
    outbound.close()
    messages = drain(subscription)
    assert [m["type"] for m in messages] == ["call_started", "final", "final", "call_ended"]
    tracks = messages[-1]["summary"]["tracks"]
    assert [(t["track"], t["segments"]) for t in tracks] == [("inbound", 1), ("outbound", 1)]


def test_a_slow_subscriber_is_dropped_not_buffered_without_bound(caplog):
    registry = CallRegistry(CallOptions(subscriber_queue=2))
    subscription = registry.subscribe("C")
    stream = registry.open("C", platform="twilio", stream_id="s", tracks=(Track(0, "inbound", CALLER),))
    for n in range(5):
        stream.event(final(n, "x", n, n + 1))
    assert subscription.overflowed
    assert len(drain(subscription)) == 2
    assert registry.get("C").num_subscribers == 0
    assert "fell 2 messages behind" in caplog.text


def test_ended_calls_expire_after_the_retention_and_make_room_for_new_ones():
    clock = Clock()
    registry = CallRegistry(CallOptions(retention_s=60, max_calls=2), clock=clock)
    for call_id in ("A", "B"):
        registry.open(call_id, platform="twilio", stream_id=call_id, tracks=(Track(0, "inbound"),)).close()
    registry.subscribe("C")  # full of ended calls: the oldest makes room
    assert registry.get("A") is None and registry.get("B") is not None
    clock.now = 61.0
    registry.subscribe("D")
    assert registry.get("B") is None
    with pytest.raises(CallsFull):
        registry.subscribe("E")  # C and D are awaited: nothing can be evicted


def test_a_subscriber_that_leaves_before_its_call_starts_leaves_nothing_behind():
    registry = CallRegistry()
    registry.subscribe("C").close()
    assert len(registry) == 0


def test_a_call_id_that_comes_back_after_its_end_is_a_new_call():
    registry = CallRegistry()
    registry.open("C", platform="twilio", stream_id="1", tracks=(Track(0, "inbound"),)).close()
    stream = registry.open("C", platform="twilio", stream_id="2", tracks=(Track(0, "inbound"),))
    messages = drain(registry.subscribe("C"))
    assert [m["type"] for m in messages] == ["call_started"]
    assert messages[0]["stream_id"] == "2" and not stream.closed


def test_webhooks_get_starts_finals_dtmf_and_the_end_but_partials_only_when_asked():
    for partials, expected in ((False, ["call_started", "final", "dtmf", "call_ended"]),
                               (True, ["call_started", "partial", "final", "dtmf", "call_ended"])):
        webhooks = RecordingWebhooks()
        registry = CallRegistry(CallOptions(webhook_url="http://hooks.test/all", webhook_partials=partials),
                                webhooks=webhooks)
        stream = registry.open("C", platform="telnyx", stream_id="s", tracks=(Track(0, "inbound", CALLER),))
        stream.event(events.SpeechStarted(0, 0.0))
        stream.event(events.Partial(0, "h", "English", 0, 1))
        stream.event(final(0, "hi", 0, 1))
        stream.dtmf("#", 1.5)
        stream.close()
        assert [message["type"] for _, message, _ in webhooks.posted] == expected
        assert {(url, key) for url, _, key in webhooks.posted} == {("http://hooks.test/all", "C")}


def test_a_call_names_its_own_webhook_only_under_an_allowed_prefix(caplog):
    webhooks = RecordingWebhooks()
    registry = CallRegistry(CallOptions(webhook_url="http://hooks.test/all",
                                        webhook_prefixes=("https://crm.test/",)), webhooks=webhooks)
    allowed = registry.open("A", platform="twilio", stream_id="1", tracks=(Track(0, "inbound"),),
                            parameters={"qasr_webhook_url": "https://crm.test/calls/A", "team": "x"})
    refused = registry.open("B", platform="twilio", stream_id="2", tracks=(Track(0, "inbound"),),
                            parameters={"qasr_webhook_url": "https://evil.test/steal"})
    allowed.close()
    refused.close()
    urls = {message["call_id"]: url for url, message, _ in webhooks.posted}
    assert urls == {"A": "https://crm.test/calls/A", "B": "http://hooks.test/all"}
    started = next(message for _, message, _ in webhooks.posted if message["type"] == "call_started")
    assert started["parameters"] == {"team": "x"}  # the webhook URL is not passed on
    assert "not under an allowed prefix" in caplog.text


def test_without_a_webhook_nothing_is_posted_and_a_url_needs_a_sender():
    with pytest.raises(ValueError, match="WebhookSender"):
        CallRegistry(CallOptions(webhook_url="http://hooks.test/"))
    with pytest.raises(ValueError, match="absolute http"):
        CallOptions(webhook_url="hooks.test")


def test_events_of_a_closed_stream_and_unknown_channels_are_refused_or_ignored():
    registry = CallRegistry()
    stream = registry.open("C", platform="twilio", stream_id="s", tracks=(Track(0, "inbound"),))
    with pytest.raises(ValueError, match="no channel 3"):
        stream.event(final(0, "x", 0, 1), channel=3)
    stream.close()
    stream.event(final(1, "late", 2, 3))
    assert [m["type"] for m in drain(registry.subscribe("C"))] == ["call_started", "call_ended"]
