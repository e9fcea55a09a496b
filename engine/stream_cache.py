"""What the engine keeps between requests of one stream, so partials do not cost time quadratic in segment length.

Encoder windows are fixed (8 s, aligned at the segment start) and attend only inside themselves, so a window that
lies wholly inside the audio never changes as the segment grows: its output is kept. The decoder KV of the prompt
prefix plus those windows' audio tokens does not change either (causal attention): it is kept in a retained slot and
copied into the next partial's slot, which then prefills only what is new. And the last partial's answer tokens: the
next partial starts from them, minus the last few (the least settled), as the official streaming does with text.

Partials only: a final is decoded from scratch, so it equals the offline transcription of the segment exactly.
(The mel's "max - 8" floor is taken over the whole clip, so a kept window can differ from a fresh encode where a
louder sound arrived later and the window held near-silence below the new floor: acceptable for a provisional
partial, never for a final.)
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch


@dataclass
class StreamState:
    windows: list[torch.Tensor] = field(default_factory=list)  # encoder outputs [window_tokens, D] of whole windows
    retained_slot: int = -1  # KV slot holding prefix_ids + the audio of `kv_windows` windows
    prefix_ids: tuple[int, ...] = ()
    kv_windows: int = 0
    answer_ids: tuple[int, ...] = ()  # the last partial's answer (its given prefix + what it generated): the next
    # partial's given prefix, rolled back


class StreamCache:
    def __init__(self, retained_slots: range, max_streams: int = 4096):
        self._free = list(reversed(retained_slots))
        self._streams: collections.OrderedDict[str, StreamState] = collections.OrderedDict()  # LRU order
        self.max_streams = max_streams  # a bound even if a caller never releases its streams

    def get(self, stream_id: str) -> StreamState:
        state = self._streams.get(stream_id)
        if state is None:
            if len(self._streams) >= self.max_streams:
                self.release(next(iter(self._streams)))  # the least recently used
            state = self._streams[stream_id] = StreamState()
        self._streams.move_to_end(stream_id)
        return state

    def peek(self, stream_id: str) -> StreamState | None:
        return self._streams.get(stream_id)

    def retained_slot(self, stream_id: str, busy: set[str]) -> int:
        """A retained KV slot for this stream: its own, a free one, or the least recently used other stream's."""
        state = self.get(stream_id)
        if state.retained_slot >= 0:
            return state.retained_slot
        if not self._free:
            for other_id, other in self._streams.items():
                if other.retained_slot >= 0 and other_id != stream_id and other_id not in busy:
                    self._free.append(other.retained_slot)
                    other.retained_slot, other.kv_windows = -1, 0
                    break
        if not self._free:
            return -1
        state.retained_slot = self._free.pop()
        return state.retained_slot

    def release(self, stream_id: str) -> None:
        state = self._streams.pop(stream_id, None)
        if state is not None and state.retained_slot >= 0:
            self._free.append(state.retained_slot)

    def __len__(self) -> int:
        return len(self._streams)
