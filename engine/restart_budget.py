"""How often a crashed engine process may be replaced: a few restarts in a window, then the engine stays down.

An engine that dies once (a CUDA error, an out-of-memory, a kill) is worth restarting: the streams stay connected. One
that dies again and again (a broken GPU, a model that cannot run) is not: restarting it forever would hide the fault
from /healthz and the orchestrator, which can replace the whole pod.
"""

from __future__ import annotations

import collections
import time
from typing import Callable


class RestartBudget:
    def __init__(self, max_restarts: int = 3, window_s: float = 300.0, *,
                 clock: Callable[[], float] = time.monotonic):
        """At most `max_restarts` restarts in any `window_s` seconds (0: never restart)."""
        if max_restarts < 0 or window_s <= 0:
            raise ValueError(f"a restart budget needs max_restarts >= 0 and window_s > 0, got {max_restarts}, "
                             f"{window_s}")
        self.max_restarts, self.window_s = max_restarts, window_s
        self._clock = clock
        self._recent: collections.deque[float] = collections.deque()  # when the restarts in the window were taken

    def take(self) -> bool:
        """Spend one restart now if the window allows it; False when the budget is exhausted."""
        now = self._clock()
        while self._recent and now - self._recent[0] >= self.window_s:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            return False
        self._recent.append(now)
        return True
