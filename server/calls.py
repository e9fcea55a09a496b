"""Calls: what telephony streams tell the integrator, who is not the party that opened the socket.

A telephony adapter opens a `CallStream` on its call (`CallRegistry.open`) and publishes through it: the sessions'
events (each on the track it came from), DTMF digits, and its end. The registry turns them into call messages and
hands each to the call's subscribers (`GET /v1/calls/{id}/events`) and to its webhook. A call may carry several
streams (Twilio can fork the two legs of one call as two streams): it starts with its first stream and ends, with
one summary, when its last stream ends.

Messages (JSON objects; every one has `type`, `call_id` and `seq`, 1, 2, ... per call):

    call_started  platform, stream_id, tracks: [{channel, track, speaker}], parameters (the platform's custom
                  parameters), metadata (the platform's call facts: numbers, account, media format)
    speech_started, partial, final, error
                  the native protocol's events (docs/protocol.md) plus channel, track, speaker, stream_id
    dtmf          digit, time (seconds from the stream's start), channel, track, speaker, stream_id
    call_ended    reason, summary: {tracks: [{channel, track, speaker, segments, speech_seconds, audio_seconds}],
                  audio_seconds, dtmf: "the digits in order"}

`track` is the platform's name for the leg ("inbound", "outbound", "external", ...); `speaker` is "caller" or
"agent" where the platform says which leg is which, else null.

Late subscribers get what they missed from the call's start (everything but partials, which later events
supersede; at most `replay_size` messages, so a gap in `seq` says some were dropped), then the live messages;
after `call_ended` the subscription ends. A call's record is kept `retention_s` after its end for late subscribers.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

from qasr.server.webhooks import WebhookSender, check_url
from qasr.streaming import events

log = logging.getLogger("qasr.calls")

CALLER = "caller"
AGENT = "agent"
WEBHOOK_PARAMETER = "qasr_webhook_url"  # the custom parameter that names a call's own webhook
WEBHOOK_TYPES = frozenset({"call_started", "final", "dtmf", "call_ended"})  # (+ "partial" when asked for)
STREAM_EVENTS = (events.SpeechStarted, events.Partial, events.Final, events.Error)  # what a call passes on


class CallsFull(Exception):
    """No room for another call record (subscribers waiting for calls that have not started, ended calls kept)."""


@dataclass(frozen=True)
class Track:
    channel: int  # the stream's channel (session) that carries this leg
    name: str  # the platform's name for it
    speaker: str | None = None  # CALLER, AGENT, or None where the platform does not say


@dataclass(frozen=True)
class CallOptions:
    webhook_url: str | None = None  # where every call's messages go unless the call names its own
    webhook_partials: bool = False  # partials too (many per utterance)
    webhook_prefixes: tuple[str, ...] = ()  # a call's own webhook URL must start with one of these; () refuses all
    replay_size: int = 1000  # messages kept per call for late subscribers
    subscriber_queue: int = 1000  # messages a subscriber may fall behind before it is dropped
    retention_s: float = 300.0  # an ended call is kept this long for late subscribers
    max_calls: int = 10_000  # call records kept at once (live, awaited by subscribers, ended)

    def __post_init__(self):
        if self.webhook_url is not None:
            check_url(self.webhook_url)
        if self.replay_size < 1 or self.subscriber_queue < 1 or self.max_calls < 1 or self.retention_s < 0:
            raise ValueError("replay_size, subscriber_queue and max_calls must be >= 1, retention_s >= 0")


@dataclass
class _TrackTotals:
    segments: int = 0
    speech_seconds: float = 0.0
    audio_seconds: float = 0.0


class Subscription:
    """One subscriber's messages: `async for message in subscription`; ends after `call_ended` (or when the
    subscriber fell more than `subscriber_queue` messages behind: then `overflowed` is True)."""

    def __init__(self, call: "Call", limit: int):
        self.call = call
        self._queue: collections.deque[dict | None] = collections.deque()
        self._limit = limit
        self._wakeup = asyncio.Event()
        self.overflowed = False
        self.finished = False  # the end was taken: iteration stays over

    def put(self, message: dict | None) -> None:
        if self.overflowed:
            return
        if message is not None and len(self._queue) >= self._limit:
            self.overflowed = True
            self._queue.append(None)
        else:
            self._queue.append(message)
        self._wakeup.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.finished:
            raise StopAsyncIteration
        while not self._queue:
            self._wakeup.clear()
            await self._wakeup.wait()
        message = self._queue.popleft()
        if message is None:
            self.finished = True
            raise StopAsyncIteration
        return message

    def close(self) -> None:
        """The subscriber left."""
        self.call.unsubscribe(self)


class Call:
    """One call's record: its streams, replay buffer, subscribers and totals."""

    def __init__(self, registry: "CallRegistry", call_id: str):
        self.registry = registry
        self.call_id = call_id
        self.started = False
        self.ended = False
        self.num_streams = 0  # streams open now
        self.webhook_url: str | None = None
        self._seq = 0
        self._replay: collections.deque[dict] = collections.deque(maxlen=registry.options.replay_size)
        self._subscribers: set[Subscription] = set()
        self._totals: dict[tuple[str, int, str], tuple[Track, _TrackTotals]] = {}  # (stream, channel, track)
        self._digits: list[str] = []

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(self) -> Subscription:
        subscription = Subscription(self, self.registry.options.subscriber_queue)
        for message in self._replay:
            subscription.put(message)
        if self.ended:
            subscription.put(None)
        else:
            self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)
        self.registry._forget_if_unused(self)

    def publish(self, message: dict) -> None:
        self._seq += 1
        message = {**message, "call_id": self.call_id, "seq": self._seq}
        if message["type"] != "partial":  # a late subscriber needs no hypothesis that a final replaced
            self._replay.append(message)
        for subscription in list(self._subscribers):
            subscription.put(message)
            if subscription.overflowed:
                log.warning("call %s: a subscriber fell %d messages behind and was dropped", self.call_id,
                            self.registry.options.subscriber_queue)
                self._subscribers.discard(subscription)
        self.registry._to_webhook(self, message)

    def _totals_for(self, stream_id: str, track: Track) -> _TrackTotals:
        key = (stream_id, track.channel, track.name)
        if key not in self._totals:
            self._totals[key] = (track, _TrackTotals())
        return self._totals[key][1]

    def _end(self, reason: str) -> None:
        tracks = [{**_track_dict(track), "segments": totals.segments, "speech_seconds": round(totals.speech_seconds, 3),
                   "audio_seconds": round(totals.audio_seconds, 3)} for track, totals in self._totals.values()]
        audio_seconds = max((entry["audio_seconds"] for entry in tracks), default=0.0)
        self.publish({"type": "call_ended", "reason": reason,
                      "summary": {"tracks": tracks, "audio_seconds": audio_seconds, "dtmf": "".join(self._digits)}})
        self.ended = True
        for subscription in self._subscribers:
            subscription.put(None)
        self._subscribers.clear()


class CallStream:
    """One stream's handle on its call: what a telephony adapter publishes through."""

    def __init__(self, call: Call, stream_id: str, tracks: tuple[Track, ...]):
        self.call = call
        self.stream_id = stream_id
        self.tracks = {track.channel: track for track in tracks}
        self.closed = False
        for track in tracks:
            call._totals_for(stream_id, track)

    @property
    def call_id(self) -> str:
        return self.call.call_id

    def track(self, channel: int) -> Track:
        if channel not in self.tracks:
            raise ValueError(f"stream {self.stream_id} has no channel {channel}")
        return self.tracks[channel]

    def event(self, event: events.ServerEvent, channel: int = 0) -> None:
        """A session's event on `channel`; ready and summary stay with the stream (the call has its own)."""
        if self.closed or not isinstance(event, STREAM_EVENTS):
            return
        track = self.track(channel)
        if isinstance(event, events.Final):
            totals = self.call._totals_for(self.stream_id, track)
            totals.segments += 1
            totals.speech_seconds += event.end - event.start
        self.call.publish({"type": event.TYPE, **dataclasses.asdict(event), **self._where(track)})  # native schema

    def dtmf(self, digit: str, time_s: float, channel: int = 0) -> None:
        if self.closed:
            return
        self.call._digits.append(digit)
        where = self._where(self.track(channel))
        self.call.publish({"type": "dtmf", "digit": digit, "time": round(time_s, 3), **where})

    def audio(self, seconds: float, channel: int = 0) -> None:
        """`seconds` more audio received on `channel` (for the summary)."""
        if not self.closed:
            self.call._totals_for(self.stream_id, self.track(channel)).audio_seconds += seconds

    def close(self, reason: str = "stop") -> None:
        """The stream ended (idempotent). The call ends with its last stream."""
        if self.closed:
            return
        self.closed = True
        self.call.registry._stream_closed(self.call, reason)

    def _where(self, track: Track) -> dict:
        return {**_track_dict(track), "stream_id": self.stream_id}


class CallRegistry:
    """Every call this server knows; used from the event loop only."""

    def __init__(self, options: CallOptions = CallOptions(), *, webhooks: WebhookSender | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if options.webhook_url is not None and webhooks is None:
            raise ValueError("a webhook URL needs a WebhookSender")
        self.options = options
        self.webhooks = webhooks
        self._clock = clock
        self._calls: dict[str, Call] = {}
        self._ended_at: dict[str, float] = {}  # call id -> when it ended, oldest first

    def get(self, call_id: str) -> Call | None:
        return self._calls.get(call_id)

    def __len__(self) -> int:
        return len(self._calls)

    def open(self, call_id: str, *, platform: str, stream_id: str, tracks: tuple[Track, ...],
             parameters: dict | None = None, metadata: dict | None = None) -> CallStream:
        """A stream of `call_id` starts: the call starts with it unless it is live already."""
        if not call_id:
            raise ValueError("a call needs an id")
        self._expire()
        call = self._calls.get(call_id)
        if call is not None and call.ended:  # the id comes back after its call ended: a new call
            self._drop(call)
            call = None
        if call is None:
            self._make_room()  # live streams are bounded by the server's session limit, never refused here
            call = self._calls[call_id] = Call(self, call_id)
        parameters = {str(key): str(value) for key, value in (parameters or {}).items()}
        stream = CallStream(call, stream_id, tracks)
        call.num_streams += 1
        if not call.started:
            call.started = True
            call.webhook_url = self._webhook_for(call, parameters)
            call.publish({"type": "call_started", "platform": platform, "stream_id": stream_id,
                          "tracks": [_track_dict(track) for track in tracks],
                          "parameters": {key: value for key, value in parameters.items() if key != WEBHOOK_PARAMETER},
                          "metadata": metadata or {}})
        return stream

    def subscribe(self, call_id: str) -> Subscription:
        """Messages of `call_id` from its start; a call that has not started yet is awaited. Raises CallsFull."""
        self._expire()
        call = self._calls.get(call_id)
        if call is None:
            self._make_room(refuse=True)
            call = self._calls[call_id] = Call(self, call_id)
        return call.subscribe()

    # -- bookkeeping -----------------------------------------------------------------------------------------

    def _stream_closed(self, call: Call, reason: str) -> None:
        call.num_streams -= 1
        if call.num_streams == 0 and not call.ended:
            call._end(reason)
            self._ended_at[call.call_id] = self._clock()
            self._expire()

    def _forget_if_unused(self, call: Call) -> None:
        """A call nobody streams and nobody waits for (its last subscriber left before it started) is dropped."""
        if not call.started and call.num_subscribers == 0 and self._calls.get(call.call_id) is call:
            del self._calls[call.call_id]

    def _expire(self) -> None:
        deadline = self._clock() - self.options.retention_s
        for call_id, ended_at in list(self._ended_at.items()):
            if ended_at > deadline:
                break
            self._drop(self._calls[call_id])

    def _make_room(self, *, refuse: bool = False) -> None:
        """Evict the oldest ended calls while full; if none is left, refuse (a subscriber) or go over (a stream)."""
        while len(self._calls) >= self.options.max_calls and self._ended_at:
            self._drop(self._calls[next(iter(self._ended_at))])
        if refuse and len(self._calls) >= self.options.max_calls:
            raise CallsFull(f"{len(self._calls)} calls are live or awaited: try again later")

    def _drop(self, call: Call) -> None:
        self._ended_at.pop(call.call_id, None)
        if self._calls.get(call.call_id) is call:
            del self._calls[call.call_id]

    # -- webhooks --------------------------------------------------------------------------------------------

    def _webhook_for(self, call: Call, parameters: dict[str, str]) -> str | None:
        """The call's own webhook (a custom parameter, if an allowed prefix matches) or the server's."""
        wanted = parameters.get(WEBHOOK_PARAMETER)
        if not wanted:
            return self.options.webhook_url
        try:
            check_url(wanted)
            allowed = self.webhooks is not None and any(wanted.startswith(prefix)
                                                        for prefix in self.options.webhook_prefixes)
        except ValueError:
            allowed = False
        if not allowed:
            log.warning("call %s: its webhook URL is not under an allowed prefix (--webhook-allow); "
                        "using the server's", call.call_id)
            return self.options.webhook_url
        return wanted

    def _to_webhook(self, call: Call, message: dict) -> None:
        if call.webhook_url is None or self.webhooks is None:
            return
        if message["type"] in WEBHOOK_TYPES or (message["type"] == "partial" and self.options.webhook_partials):
            self.webhooks.submit(call.webhook_url, message, key=call.call_id)


def _track_dict(track: Track) -> dict:
    return {"channel": track.channel, "track": track.name, "speaker": track.speaker}
