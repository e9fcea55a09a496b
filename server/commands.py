"""What a wire adapter asks of its connection: the commands every adapter's `receive` returns.

Any adapter (the native protocol, OpenAI Realtime, Deepgram, the telephony ones) turns its own client messages into
these; `StreamConnection` carries them out on the stream's session, so the connection never knows a wire format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import numpy as np

from qasr.streaming.settings import StreamSettings


@dataclass(frozen=True)
class Start:
    """Open the stream with these settings (built from the server's defaults and checked against its limits)."""

    settings: StreamSettings


@dataclass(frozen=True)
class Audio:
    samples: np.ndarray = field(repr=False)  # float32 [frames, channels] at settings.sample_rate, in [-1, 1]


@dataclass(frozen=True)
class Flush:
    """Finalise the open segment now (of one channel; None: the stream's only channel)."""

    channel: int | None = None


@dataclass(frozen=True)
class End:
    """No more audio: finalise, send every final, then the summary, then close normally."""


@dataclass(frozen=True)
class Notice:
    """A problem that is not fatal: answer with an `error` event and carry on."""

    code: str
    message: str


@dataclass(frozen=True)
class Reply:
    """Protocol-level answers (a pong, session.updated, ConfigureSuccess): sent as they are, in order with events."""

    frames: list[str | bytes]


Command = Union[Start, Audio, Flush, End, Notice, Reply]
