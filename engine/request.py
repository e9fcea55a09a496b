"""What a session asks of the engine, and what it gets back.

The server and the sessions speak only these types; the engine (eager on the CPU, CUDA graphs on a GPU) turns a
`DecodeRequest` into a `DecodeResult`. See `qasr.engine.face.SpeechEngine` for the engine's face.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


class Priority(enum.IntEnum):
    """Lower runs first: finals outrank partials, so under load partials thin out before finals slow down."""

    FINAL = 0
    PARTIAL = 1


class Superseded(Exception):
    """A queued partial was replaced by a newer partial of the same stream before it ran."""


class EngineClosed(Exception):
    """The engine is shutting down (or failed) and takes no more work."""


class EngineCrashed(Exception):
    """The engine process died (a device error, out of memory, a kill) while it held this request. Not EngineClosed:
    the engine restarts, so only this request is lost (a stream gets an empty final for it and goes on)."""


class WordTime(NamedTuple):
    """One aligned word: seconds from the start of the clip, to the ms (the aligner's own type, torch-free here)."""

    word: str
    start: float
    end: float


@dataclass(frozen=True, eq=False)
class DecodeRequest:
    audio: np.ndarray  # float32, 16 kHz mono: the whole segment (so far, for a partial)
    context: str = ""  # system text: names, topic, spelling hints
    language: str | None = None  # forced language (canonical name, e.g. "English"); None = automatic
    priority: Priority = Priority.FINAL
    stream_id: str | None = None  # requests of one stream may reuse encoder windows and decoder KV; a newer
    # queued PARTIAL of the same stream supersedes an older queued one, and a PARTIAL continues the stream's previous
    # partial (its answer minus the engine's rollback_tokens, as given tokens). Finals never do.
    max_new_tokens: int | None = None  # None: the engine's budget for this audio length
    words: bool = False  # FINAL only, on an engine with an aligner: word times on the result (aligned after the
    # decode, in one batch with the other finals that asked; finals that did not ask never wait for it)


@dataclass(frozen=True)
class DecodeResult:
    text: str  # the transcript (language tag stripped, repetition guard applied)
    language: str  # canonical language name, "" when the model heard no speech
    raw_text: str  # the decoded answer as the model wrote it, including a partial's given prefix
    token_ids: tuple[int, ...]  # generated tokens (without the prompt or the given prefix, without EOS)
    finish_reason: str  # "eos" | "length" | "repetition"
    num_audio_tokens: int
    timings: dict[str, float] = field(default_factory=dict)  # queue_ms, encode_ms, prefill_ms, decode_ms (align_ms)
    words: tuple[WordTime, ...] | None = None  # asked for words: (word, start, end) in seconds from the start of
    # the request's audio (the caller offsets them to its own timeline); None when not asked
    words_reason: str | None = None  # asked for words and got none: why (a language the aligner does not support,
    # no words in the text, the aligner failed)
