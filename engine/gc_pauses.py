"""How long Python's garbage collector stopped a process: every collection timed through `gc.callbacks`.

A collection holds the GIL from start to end, so in the engine process it stops the decode loop and every request
reader at once: a long one shows up as a stall of every stream's step (#15, the p95 of finals at 600+ streams varied
from run to run while their p90 held). `GcPauses.watch()` starts counting; `summary()` says what it saw.
"""

from __future__ import annotations

import gc
import threading
import time

LONG_PAUSE_S = 0.05  # a collection this long delays every running stream's next token by about as much


class GcPauses:
    def __init__(self):
        self.count = [0, 0, 0]  # collections per generation
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._started: float | None = None
        self._lock = threading.Lock()

    @classmethod
    def watch(cls) -> "GcPauses":
        pauses = cls()
        gc.callbacks.append(pauses._callback)
        return pauses

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        spent, self._started = time.perf_counter() - self._started, None
        generation = min(int(info.get("generation", 0)), 2)
        with self._lock:
            self.count[generation] += 1
            self.seconds[generation] += spent
            self.longest[generation] = max(self.longest[generation], spent)

    @property
    def longest_pause(self) -> float:
        return max(self.longest)

    def summary(self) -> str:
        return ", ".join(f"generation {g}: {self.count[g]} collections, {self.seconds[g] * 1e3:.0f} ms in all, the "
                         f"longest {self.longest[g] * 1e3:.1f} ms" for g in range(3))
