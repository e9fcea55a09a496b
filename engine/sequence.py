"""One request's life inside the engine: waiting -> running in a slot -> finished."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from qasr.model.prompt import Prompt

from .request import DecodeRequest, DecodeResult

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: DecodeRequest
    on_done: Callable[[DecodeResult | BaseException], None]  # called once, on the engine thread
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    cancelled: bool = False  # set from any thread; the engine drops the sequence at its next step
    slot: int = -1
    prompt: Prompt | None = None
    budget: int = 0  # new tokens allowed
    generated: list[int] = field(default_factory=list)
    finish_reason: str = ""
    t_submit: float = field(default_factory=time.perf_counter)
    t_decode: float = 0.0  # when its row was put into decode (end of prefill; with nothing else decoding on CUDA,
    # its prefill may still be running then: the decode stream waits for it on the device)
    first_launch: int | None = None  # the first decode launch its row is in (None: not started); outputs of
    # launches before it (queued ahead, while the slot was another row's or idle) are not its own
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def stream_id(self) -> str | None:
        return self.request.stream_id

    def finish(self, result: DecodeResult | BaseException) -> None:
        if self.status is Status.FINISHED:
            return
        self.status = Status.FINISHED
        self.on_done(result)
