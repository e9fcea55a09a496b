"""Which sequences run: the waiting queues, the running sequences and the decode slots they occupy.

Finals before partials, FIFO within each; a newer queued partial of a stream supersedes its older queued one; free
slots are handed out lowest first (a small top slot keeps the decode step's bucket small). `add` and the queue reads
are thread-safe (sessions add work from the event loop); everything else runs on the engine thread.
"""

from __future__ import annotations

import collections
import heapq
import threading
from typing import Callable

from .request import Priority, Superseded
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._waiting: dict[Priority, collections.deque[Sequence]] = {p: collections.deque() for p in Priority}
        self._queued_partial: dict[str, Sequence] = {}  # stream_id -> its one queued partial
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self._free_slots = list(range(num_slots))  # min-heap

    # -- waiting ---------------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; an older queued partial of the same stream is finished with Superseded."""
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

    def can_admit(self) -> bool:
        return bool(self._free_slots) and len(self) > 0

    def schedule(self, max_tokens: int, cost: Callable[[Sequence], int]) -> list[Sequence]:
        """The waiting sequences to admit now: as many as there are free slots, within a prefill token budget."""
        return self.take(len(self._free_slots), max_tokens, cost)

    def take(self, max_sequences: int, max_tokens: int, cost: Callable[[Sequence], int]) -> list[Sequence]:
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

    def depths(self) -> dict[str, int]:
        with self._lock:
            return {p.name.lower(): len(q) for p, q in self._waiting.items()}

    def __len__(self) -> int:
        """Sequences waiting."""
        with self._lock:
            return sum(len(q) for q in self._waiting.values())

    # -- running ---------------------------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free_slots)

    def place(self, seq: Sequence) -> int:
        """Give `seq` the lowest free slot; it runs from now on."""
        seq.slot = heapq.heappop(self._free_slots)
        self.running[seq.slot] = seq
        return seq.slot

    def release(self, seq: Sequence) -> None:
        """`seq` stopped running (finished or dropped): its slot is free again."""
        if self.running.pop(seq.slot, None) is seq:
            heapq.heappush(self._free_slots, seq.slot)

    def drop_cancelled(self) -> list[Sequence]:
        """Running sequences whose waiter gave up, released from their slots."""
        dropped = [seq for seq in self.running.values() if seq.cancelled]
        for seq in dropped:
            self.release(seq)
        return dropped

    def running_streams(self) -> set[str]:
        return {seq.stream_id for seq in self.running.values() if seq.stream_id}

    def drain(self) -> list[Sequence]:
        """Remove and return everything waiting or running, every slot free again (engine shutdown)."""
        with self._lock:
            out = [s for q in self._waiting.values() for s in q]
            for q in self._waiting.values():
                q.clear()
            self._queued_partial.clear()
        out += list(self.running.values())
        self.running.clear()
        self._free_slots = list(range(self.num_slots))
        return out
