"""The events a stream has made and its client has not taken yet, in order: one queue for a `Session` and for a
`MultichannelSession`, which both hand their events out through it."""

from __future__ import annotations

import collections

from qasr.streaming import events

BACKLOG_EVENTS = 8  # untaken events beyond which a new partial replaces an untaken one of the same segment


class EventOutbox:
    def __init__(self):
        self._events: collections.deque[events.ServerEvent] = collections.deque()
        self.num_finals = 0  # finals put and not yet taken: what backpressure counts

    def put(self, event: events.ServerEvent) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(event, events.Partial) and isinstance(last, events.Partial) \
                and len(self._events) >= BACKLOG_EVENTS \
                and (last.channel, last.segment_id) == (event.channel, event.segment_id):
            self._events[-1] = event  # a reader that fell behind gets the newest hypothesis, not a backlog
        else:
            self._events.append(event)
        if isinstance(event, events.Final):
            self.num_finals += 1

    def take(self) -> events.ServerEvent | None:
        """The oldest untaken event, or None when there is none now."""
        if not self._events:
            return None
        event = self._events.popleft()
        if isinstance(event, events.Final):
            self.num_finals -= 1
        return event

    def clear(self) -> None:
        self._events.clear()
        self.num_finals = 0
