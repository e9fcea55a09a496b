"""Python's garbage collector in the engine process: the loaded heap frozen, every collection timed.

A collection holds the GIL from start to end, so in the engine process it stops the decode loop and every request
reader at once: a long one is a stall of every stream's step. On the H200 at 600 streams (#15) one full collection
stopped the engine process for 204 ms, and the finals' p95 jumped between 128 and 277 ms from run to run while their
p90 held. A full collection walks every object the process holds, and after loading that is ~300,000 of them (the
model's modules and tensors, the tokenizer, Triton's and the graphs' objects: 125 ms for the tiny model on the CPU)
that live as long as the process. `freeze_loaded_heap()` moves them out of the collector's sight (`gc.freeze`):
the same collection then takes ~0.01 ms. `thaw()` gives them back before the process exits (left frozen, they are
never freed, and Triton's bindings report them as leaked at exit).

`GcPauses.watch()` times every collection from then on (`gc.callbacks`); `summary()` says what it saw.
"""

from __future__ import annotations

import gc
import time

LONG_PAUSE_S = 0.05  # a collection this long delays every running stream's next token by about as much


def freeze_loaded_heap() -> int:
    """Collect once, then freeze what is left (the loaded engine) -> the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    gc.unfreeze()


class GcPauses:
    def __init__(self):
        self.frozen = gc.get_freeze_count()  # objects the collections do not walk
        self.count = [0, 0, 0]  # collections per generation
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._started: float | None = None  # no lock: a collection runs whole under the GIL, one at a time

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
        self.count[generation] += 1
        self.seconds[generation] += spent
        self.longest[generation] = max(self.longest[generation], spent)

    @property
    def longest_pause(self) -> float:
        return max(self.longest)

    def summary(self) -> str:
        generations = (f"generation {g}: {self.count[g]} collections, {self.seconds[g] * 1e3:.0f} ms in all, "
                       f"the longest {self.longest[g] * 1e3:.1f} ms" for g in range(3))
        return f"{self.frozen} objects frozen; " + ", ".join(generations)
