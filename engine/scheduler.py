"""One queue for all sessions: finals before partials, stale partials superseded, admission between decode steps.

Thread-safe: sessions add work from the event loop while the engine thread takes it.
"""

from __future__ import annotations

import collections
import threading

from .request import Priority, Superseded
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self):
        self._lock = threading.Lock()
        self._waiting: dict[Priority, collections.deque[Sequence]] = {p: collections.deque() for p in Priority}
        self._queued_partial: dict[str, Sequence] = {}  # stream_id -> its one queued partial

    def add(self, seq: Sequence) -> Sequence | None:
        """Queue `seq`; returns the older queued partial of the same stream it supersedes (already dropped)."""
        stale = None
        with self._lock:
            req = seq.request
            if req.priority is Priority.PARTIAL and req.stream_id is not None:
                stale = self._queued_partial.pop(req.stream_id, None)
                if stale is not None:
                    self._waiting[Priority.PARTIAL].remove(stale)
                self._queued_partial[req.stream_id] = seq
            self._waiting[req.priority].append(seq)
        if stale is not None:
            stale.finish(Superseded(f"a newer partial of stream {req.stream_id} replaced this one"))
        return stale

    def take(self, max_sequences: int, max_tokens: int, cost) -> list[Sequence]:
        """Up to `max_sequences` waiting sequences, finals first then FIFO, within a prefill token budget.

        cost(seq) -> prompt tokens the sequence will prefill. The first one is always taken (so a long prompt
        cannot starve), the rest while they fit. Cancelled sequences are dropped on the way.
        """
        taken, tokens = [], 0
        with self._lock:
            for priority in Priority:
                queue = self._waiting[priority]
                while queue and len(taken) < max_sequences:
                    seq = queue[0]
                    if seq.cancelled:
                        self._forget(queue.popleft())
                        continue
                    need = cost(seq)
                    if taken and tokens + need > max_tokens:
                        return taken
                    self._forget(queue.popleft())
                    seq.status = Status.RUNNING
                    taken.append(seq)
                    tokens += need
        return taken

    def _forget(self, seq: Sequence) -> None:
        sid = seq.request.stream_id
        if sid is not None and self._queued_partial.get(sid) is seq:
            del self._queued_partial[sid]

    def drain(self) -> list[Sequence]:
        """Remove and return everything waiting (engine shutdown)."""
        with self._lock:
            out = [s for q in self._waiting.values() for s in q]
            for q in self._waiting.values():
                q.clear()
            self._queued_partial.clear()
        return out

    def depths(self) -> dict[str, int]:
        with self._lock:
            return {p.name.lower(): len(q) for p, q in self._waiting.items()}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._waiting.values())
