"""The audio sent on one connection, kept so that what the server never read can be sent again after a reconnect.

A server that shuts down (SIGTERM: the open segments' finals, `summary`, close 1001) stops reading at once: audio
the client had already sent (in its socket, a proxy's, the server's receive queue) is never transcribed, though the
client's send of it succeeded. The drain's `summary` says how much the server read (`audio_seconds`), so
`AudioStream` sends the rest again, first, on its next connection. Only the last `window_samples` are kept (bounded
memory); unread audio older than that cannot be sent again.
"""

from __future__ import annotations

import collections

import numpy as np


class SentAudio:
    """The last `window_samples` (at least) frames sent on the current connection, as the chunks they were sent in."""

    def __init__(self, window_samples: int):
        if window_samples < 0:
            raise ValueError(f"window_samples must be >= 0, got {window_samples}")
        self.window_samples = window_samples
        self._chunks: collections.deque[np.ndarray] = collections.deque()
        self.num_samples = 0  # frames held

    def add(self, chunk: np.ndarray) -> None:
        """A chunk ([n] or [n, channels]) that was sent; a copy is kept (a source may reuse its buffers)."""
        if self.window_samples == 0 or len(chunk) == 0:
            return
        self._chunks.append(np.array(chunk, copy=True))
        self.num_samples += len(chunk)
        while self.num_samples - len(self._chunks[0]) >= self.window_samples:  # the rest still covers the window
            self.num_samples -= len(self._chunks.popleft())

    def tail(self, num_samples: int) -> list[np.ndarray]:
        """The last min(num_samples, held) frames sent, in order, as chunks (the first one cut to fit)."""
        wanted = min(max(num_samples, 0), self.num_samples)
        chunks: list[np.ndarray] = []
        for chunk in reversed(self._chunks):
            if wanted <= 0:
                break
            part = chunk[-wanted:] if len(chunk) > wanted else chunk
            chunks.append(part)
            wanted -= len(part)
        return chunks[::-1]

    def clear(self) -> None:
        self._chunks.clear()
        self.num_samples = 0
