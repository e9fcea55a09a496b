"""A multichannel stream, sans-I/O: one `Session` per channel behind the face of one Session.

A stream with `StreamSettings.multichannel` carries one speaker per channel (a call's caller and agent, a stereo
interview): each channel gets its own resampler, VAD, segment ids and timeline (times are seconds from the start
of the stream on every channel). `MultichannelSession` runs one `Session` per channel and looks like one to
whoever drives it (qasr.server.stream_runner), so the runner and the connection need not know how many channels a
stream has:

- `feed` takes [frames, channels] and hands each channel its column; `flush(channel)` closes one channel's open
  segment, `flush()` every channel's;
- every event of channel c carries `channel=c`; the events are handed out in the order they were made;
- each channel's requests are renumbered into one id space (`on_result` routes an outcome back to its channel);
- each channel's summary is held back; one summary covering every channel follows the last channel's final.

Each channel holds to its own `max_pending_finals`; the finals not yet taken are bounded by it once more overall.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

import numpy as np

from qasr.audio import SAMPLE_RATE
from qasr.streaming import events
from qasr.streaming.outbox import EventOutbox
from qasr.streaming.session import Cancel, Decode, EngineAction, Session, SessionObserver
from qasr.streaming.settings import StreamSettings


class MultichannelSession:
    """One stream of `settings.channels` independently segmented channels. Same methods as `Session`, plus
    `flush(channel)`."""

    def __init__(self, session_id: str, settings: StreamSettings, *, max_pending_finals: int = 16,
                 observer: SessionObserver | None = None, clock: Callable[[], float] = time.monotonic):
        if not settings.multichannel:
            raise ValueError("MultichannelSession serves multichannel streams; use Session for the others")
        self.session_id = session_id
        self.settings = settings
        self.max_pending_finals = max_pending_finals
        mono = dataclasses.replace(settings, channels=1, multichannel=False)
        # "{session_id}.{channel}" keeps every channel's engine stream ids ("{id}/{segment}") apart
        self.channels = [Session(f"{session_id}.{channel}", mono, max_pending_finals=max_pending_finals,
                                 observer=observer, clock=clock) for channel in range(settings.channels)]
        self._request_ids = itertools.count()
        self._requests: dict[int, tuple[int, int]] = {}  # our request id -> (channel, its session's request id)
        self._our_ids: dict[tuple[int, int], int] = {}  # the reverse
        self._actions: list[EngineAction] = []
        self._outbox = EventOutbox()
        self._summarised: set[int] = set()  # channels whose summary came

    # -- input -------------------------------------------------------------------------------------------------

    def feed(self, samples: np.ndarray) -> None:
        """Take the next audio: float32 [frames, channels] at settings.sample_rate."""
        samples = np.asarray(samples)
        if samples.ndim != 2 or samples.shape[1] != len(self.channels):
            raise ValueError(f"expected [frames, {len(self.channels)}] samples, got shape {samples.shape}")
        for channel, session in enumerate(self.channels):
            session.feed(np.ascontiguousarray(samples[:, channel]))
            self._collect(channel)

    def flush(self, channel: int | None = None) -> None:
        """Close the open segment of `channel` (None: of every channel) now; its final follows."""
        if channel is not None and not 0 <= channel < len(self.channels):
            raise ValueError(f"channel {channel} is not one of the stream's channels 0..{len(self.channels) - 1}")
        for index in range(len(self.channels)) if channel is None else (channel,):
            self.channels[index].flush()
            self._collect(index)

    def end(self) -> None:
        """No more audio: every channel's open segment closes; the summary follows the last final."""
        for channel, session in enumerate(self.channels):
            session.end()
            self._collect(channel)

    def notify(self, event) -> None:
        """Queue an event from outside (see Session.notify) in order with the channels' events."""
        self._emit(event)

    # -- engine work -------------------------------------------------------------------------------------------

    def take_actions(self) -> list[EngineAction]:
        actions, self._actions = self._actions, []
        return actions

    def on_result(self, request_id: int, result) -> None:
        """An outcome for one of the channels' requests (see Session.on_result); unknown ids are ignored."""
        route = self._requests.pop(request_id, None)
        if route is None:
            return
        del self._our_ids[route]
        channel, channel_request_id = route
        self.channels[channel].on_result(channel_request_id, result)
        self._collect(channel)

    def abort(self) -> None:
        for channel, session in enumerate(self.channels):
            session.abort()
            self._collect(channel)
        self._outbox.clear()

    # -- output --------------------------------------------------------------------------------------------------

    def take_event(self):
        return self._outbox.take()

    @property
    def has_capacity(self) -> bool:
        """False while one channel has max_pending_finals finals being decoded, or that many finals are untaken."""
        return self._outbox.num_finals < self.max_pending_finals and all(session.has_capacity
                                                                      for session in self.channels)

    @property
    def num_in_flight(self) -> int:
        return sum(session.num_in_flight for session in self.channels)

    def summary(self) -> events.Summary:
        """Every channel's segments; the audio the stream received (its length, once, not per channel)."""
        return events.Summary(segments=sum(session.num_finals for session in self.channels),
                              audio_seconds=self.channels[0].input_samples / self.settings.sample_rate,
                              speech_seconds=sum(session.speech_samples for session in self.channels) / SAMPLE_RATE)

    # -- the channels' output ------------------------------------------------------------------------------------

    def _collect(self, channel: int) -> None:
        """Take what one channel's session produced: its actions renumbered, its events tagged with the channel."""
        session = self.channels[channel]
        for action in session.take_actions():
            action = self._renumbered(channel, action)
            if action is not None:
                self._actions.append(action)
        while (event := session.take_event()) is not None:
            if isinstance(event, events.Summary):
                self._summarised.add(channel)
                if len(self._summarised) == len(self.channels):
                    self._emit(self.summary())
            else:
                self._emit(dataclasses.replace(event, channel=channel))

    def _renumbered(self, channel: int, action: EngineAction) -> EngineAction | None:
        if isinstance(action, Decode):
            request_id = next(self._request_ids)
            self._requests[request_id] = (channel, action.request_id)
            self._our_ids[(channel, action.request_id)] = request_id
            return dataclasses.replace(action, request_id=request_id)
        if isinstance(action, Cancel):
            request_id = self._our_ids.pop((channel, action.request_id), None)
            if request_id is None:
                return None  # already answered: nothing left to cancel
            del self._requests[request_id]
            return Cancel(request_id)
        return action  # Release: stream ids are already distinct per channel

    def _emit(self, event) -> None:
        self._outbox.put(event)
