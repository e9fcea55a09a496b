"""What a client may consume once connected: per key (concurrent streams, audio seconds per minute, shared by all
the key's connections) and per connection (message rate, total audio of the stream).

`GuardedAdapter` wraps any wire adapter (qasr.server.connection.WireAdapter) and counts what its `receive` lets
through; going over a limit raises `LimitExceeded`, a ProtocolError closing with 1008 and a reason that names the
limit, after the stream's open segments get their finals. Sans-I/O: the clock is injectable.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

from qasr.server import errors
from qasr.server.auth import Principal
from qasr.server.commands import Audio, Command, Start


class LimitExceeded(errors.ProtocolError):
    """A client went over one of its limits: 1008 (policy violation); `error_code` names which."""

    close_code = errors.POLICY_VIOLATION
    error_code = "limit_exceeded"

    def __init__(self, error_code: str, message: str):
        super().__init__(message)
        self.error_code = error_code


@dataclass(frozen=True)
class ClientLimits:
    """Per connection, whatever its key."""

    max_messages_per_s: float = 250.0  # sustained; a 20 ms telephony frame per track is 50/s
    message_burst: int = 1000  # messages allowed at once above the rate (a client catching up after a stall)
    max_stream_audio_s: float | None = 4 * 3600.0  # audio one stream may send in all (None: unbounded)

    def __post_init__(self):
        if not (math.isfinite(self.max_messages_per_s) and self.max_messages_per_s > 0):
            raise ValueError(f"max_messages_per_s must be > 0, got {self.max_messages_per_s}")
        if self.message_burst < 1:
            raise ValueError(f"message_burst must be >= 1, got {self.message_burst}")
        if self.max_stream_audio_s is not None and not self.max_stream_audio_s > 0:
            raise ValueError(f"max_stream_audio_s must be > 0, got {self.max_stream_audio_s}")


class KeyUsage:
    """Every key's open streams and the audio its streams sent over the last minute (one-second buckets)."""

    WINDOW_S = 60

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.streams: collections.Counter[str] = collections.Counter()
        self._audio: dict[str, collections.deque] = {}  # name -> deque of [second, audio seconds]

    def open_stream(self, principal: Principal) -> None:
        """Count one more stream of the key; LimitExceeded if it already has its maximum."""
        limit = principal.limits.max_streams
        if principal.name is None:
            return
        if limit is not None and self.streams[principal.name] >= limit:
            raise LimitExceeded("key_stream_limit", f"this API key already has {limit} open streams (its limit)")
        self.streams[principal.name] += 1

    def close_stream(self, principal: Principal) -> None:
        if principal.name is None or self.streams[principal.name] <= 0:
            return
        self.streams[principal.name] -= 1
        if not self.streams[principal.name]:
            del self.streams[principal.name]

    def add_audio(self, principal: Principal, seconds: float) -> None:
        """Count audio against the key's per-minute limit; LimitExceeded once over it."""
        limit = principal.limits.audio_seconds_per_minute
        if principal.name is None or limit is None:
            return
        now = int(self.clock())
        buckets = self._audio.setdefault(principal.name, collections.deque())
        while buckets and buckets[0][0] <= now - self.WINDOW_S:
            buckets.popleft()
        if buckets and buckets[-1][0] == now:
            buckets[-1][1] += seconds
        else:
            buckets.append([now, seconds])
        used = sum(bucket[1] for bucket in buckets)
        if used > limit:
            raise LimitExceeded("key_audio_limit", f"this API key sent {used:.0f} s of audio in the last minute, over "
                                                   f"its limit of {limit:g} s")

    def audio_last_minute(self, name: str) -> float:
        now = int(self.clock())
        return sum(seconds for second, seconds in self._audio.get(name, ()) if second > now - self.WINDOW_S)


class GuardedAdapter:
    """A wire adapter whose client is held to its limits; everything else is the wrapped adapter's."""

    def __init__(self, adapter, *, principal: Principal, usage: KeyUsage, limits: ClientLimits,
                 clock=time.monotonic):
        self.adapter = adapter
        self.principal = principal
        self.usage = usage
        self.limits = limits
        self.clock = clock
        self.audio_s = 0.0  # this stream's audio so far
        self._sample_rate: int | None = None
        self._tokens = float(limits.message_burst)  # token bucket for the message rate
        self._refilled_at = clock()

    def greeting(self) -> list[str | bytes]:
        return self.adapter.greeting()

    def encode(self, event) -> list[str | bytes]:
        return self.adapter.encode(event)

    def receive(self, message: str | bytes) -> list[Command]:
        self._take_token()
        commands = self.adapter.receive(message)
        for command in commands:
            if isinstance(command, Start):
                self._sample_rate = command.settings.sample_rate
            elif isinstance(command, Audio) and self._sample_rate:
                self._count_audio(len(command.samples) / self._sample_rate)
        return commands

    def __getattr__(self, name):  # close(), settings, ... of the adapter itself
        return getattr(self.adapter, name)

    def _take_token(self) -> None:
        now = self.clock()
        rate = self.limits.max_messages_per_s
        self._tokens = min(float(self.limits.message_burst), self._tokens + (now - self._refilled_at) * rate)
        self._refilled_at = now
        if self._tokens < 1:
            raise LimitExceeded("rate_limited", f"more than {rate:g} messages per second (burst "
                                                f"{self.limits.message_burst}): send larger audio frames")
        self._tokens -= 1

    def _count_audio(self, seconds: float) -> None:
        self.audio_s += seconds
        limit = self.limits.max_stream_audio_s
        if limit is not None and self.audio_s > limit:
            raise LimitExceeded("stream_audio_limit", f"the stream sent more than {limit:g} s of audio (its limit): "
                                                      "open a new stream")
        self.usage.add_audio(self.principal, seconds)
