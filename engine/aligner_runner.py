"""Word times for the finals that asked: the forced aligner run after their decode, many finals per forward.

A final whose request has `words=True` is not handed out when its decode stops: the engine parks it here with its
result, and `run()` aligns up to `max_batch` parked finals in one forward of the aligner (qasr.model.aligner: mel,
encoder windows of all clips packed, one causal pass, argmax at the timestamp slots, the monotonic repair). The
engine calls `run()` at its admission cadence, so the finals that stopped during one admission interval share a
forward; finals that did not ask never come here and never wait.

The forward is eager (packed encoder windows, right-padded decoder rows): no CUDA-graph buckets yet, since its shapes
vary with every clip and transcript. Times are seconds from the start of the request's audio; the caller offsets them
to its own timeline (the session by the segment's start). A word cannot be said after its clip ended: times the
aligner puts past the clip's end (a model error; random test weights do it all the time) are clamped to it, which
keeps them in order.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from qasr.audio import SAMPLE_RATE

from .request import DecodeResult, WordTime
from .sequence import Sequence

if TYPE_CHECKING:
    from qasr.model.aligner import ForcedAligner

log = logging.getLogger(__name__)

FAILED_REASON = "the aligner failed on this segment"  # what a client sees; the log has the details


class AlignerRunner:
    """Parked finals waiting for their word times, and the one call that aligns a batch of them."""

    def __init__(self, aligner: "ForcedAligner", *, max_batch: int = 32):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.aligner = aligner
        self.max_batch = max_batch
        self._parked: list[tuple[Sequence, DecodeResult, float]] = []  # (final, its result, when it was parked)
        self.num_batches = 0  # forwards run
        self.num_rows = 0  # finals aligned (with words or a reason)

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, seq: Sequence, result: DecodeResult) -> None:
        """Hold a decoded final until `run()` has its word times."""
        self._parked.append((seq, result, time.perf_counter()))

    def run(self) -> int:
        """Align the oldest `max_batch` parked finals in one forward and finish them; returns how many finished.

        A parked final whose request was cancelled meanwhile is finished with CancelledError, not aligned. If the
        forward fails, the batch's finals still complete, with no words and a reason."""
        batch, self._parked = self._parked[: self.max_batch], self._parked[self.max_batch:]
        live = []
        for seq, result, parked_at in batch:
            if seq.cancelled:
                seq.finish(asyncio.CancelledError())
            else:
                live.append((seq, result, parked_at))
        if not live:
            return len(batch)
        try:
            alignments = self.aligner.align([seq.request.audio for seq, _, _ in live],
                                            [result.text for _, result, _ in live],
                                            [result.language or None for _, result, _ in live])
            answers = [(clamped(a.words, len(seq.request.audio) / SAMPLE_RATE), a.reason)
                       for a, (seq, _, _) in zip(alignments, live)]
        except Exception:  # the decode is good: never lose a final because its word times failed
            log.exception("aligning %d finals failed", len(live))
            answers = [((), FAILED_REASON)] * len(live)
        self.num_batches += 1
        self.num_rows += len(live)
        done = time.perf_counter()
        for (seq, result, parked_at), (words, reason) in zip(live, answers):
            timings = dict(result.timings, align_ms=(done - parked_at) * 1e3)
            seq.finish(_with_words(result, words, reason, timings))
        return len(batch)

    def fail_all(self, error: BaseException) -> None:
        parked, self._parked = self._parked, []
        for seq, _, _ in parked:
            seq.finish(error)


def _with_words(result: DecodeResult, words: tuple[WordTime, ...], reason: str | None, timings: dict) -> DecodeResult:
    return replace(result, words=words, words_reason=reason if not words else None, timings=timings)


def clamped(words, seconds: float) -> tuple[WordTime, ...]:
    """(word, start, end) triples as WordTimes inside [0, seconds] (seconds: the clip's length, to the ms)."""
    limit = math.floor(seconds * 1000) / 1000
    return tuple(WordTime(word, min(start, limit), min(end, limit)) for word, start, end in words)
