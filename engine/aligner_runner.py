"""Word times for the finals that asked: the forced aligner run after their decode, beside it, many finals per forward.

A final whose request has `words=True` is not handed out when its decode stops: the engine parks it here with its
result, and its words are split and tokenized then (a final that cannot be aligned gets its reason at once). While rows
decode, a forward is due once `min_batch` finals are parked or the oldest has waited `max_wait_ms` (fewer, fuller
forwards: `can_launch`); with nothing decoding, at once. `launch()` takes up to `max_batch` parked finals, lays the
batch out (qasr.model.aligner_batch), stages the clips and the layout in pinned memory, and queues the forward
(qasr.model.aligner: mel, encoder windows of all clips packed, one causal pass, argmax at every position) on a CUDA
stream of its own, replaying CUDA graphs (qasr.engine.aligner_graphs) when the batch fits a bucket; then it records an
event and returns, having waited for the device nowhere (no value read back, no blocking copy: a test watches for
them). The engine keeps decoding on its stream meanwhile, at a higher priority when it decodes on qasr.engine.streams'
`decode_stream()`: the aligner's stream has CUDA's lowest priority, so the GPU schedules a decode step's blocks before
the aligner's waiting ones. The aligner needs nothing the decode stream makes (its own mel and encoder, from the
request's audio on the host), so no event joins the two streams. `poll()`, called every engine step, finishes the batch
once its event has completed: it reads the small [rows, tokens] class tensor, repairs each row's times (the monotonic
repair) and hands the finals out. One batch is in flight at a time (the graphs' static buffers are its inputs), of at
most `max_batch` finals (EngineOptions.aligner_max_batch): that bounds the aligner's share of the GPU at any moment;
finals that stop meanwhile wait for the next launch, which comes only once the one in flight is done. Finals that did
not ask never come here and never wait. On the CPU (tests, small deployments) the same calls run the forward
synchronously: `launch()` then `poll()` completes at once.

Times are seconds from the start of the request's audio; the caller offsets them to its own timeline (the session by
the segment's start). A word cannot be said after its clip ended: times the aligner puts past the clip's end (a model
error; random test weights do it all the time) are clamped to it, which keeps them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from qasr.audio import SAMPLE_RATE
from qasr.model.aligner_repair import word_times

from .aligner_graphs import AlignerGraphs
from .request import DecodeResult, WordTime
from .sequence import Sequence
from .streams import aligner_stream

if TYPE_CHECKING:
    from qasr.model.aligner import AlignerInput, ForcedAligner
    from qasr.model.aligner_batch import AlignerBatch

log = logging.getLogger(__name__)

FAILED_REASON = "the aligner failed on this segment"  # what a client sees; the log has the details
POLL_SLEEP_S = 0.0002  # between checks of an in-flight batch when the engine has nothing else to do


@dataclass
class Parked:
    seq: Sequence
    result: DecodeResult
    parked_at: float  # perf_counter
    item: "AlignerInput"  # its words split and tokenized when it was parked


@dataclass
class InFlight:
    """A launched batch: its finals, what the host needs to read its result, and the event that says it is there."""

    finals: list[Parked]
    inputs: list["AlignerInput"]
    batch: "AlignerBatch"
    classes: torch.Tensor  # [rows, tokens] on the host (pinned on CUDA; filled once `done` has completed)
    done: torch.cuda.Event | None  # None: computed synchronously (CPU)


class AlignerRunner:
    """Parked finals waiting for their word times; at most one batch of them aligning at a time."""

    def __init__(self, aligner: "ForcedAligner", *, max_batch: int = 32, min_batch: int = 1, max_wait_ms: float = 0.0,
                 cuda_graphs: bool | None = None):
        """min_batch, max_wait_ms: while the engine decodes, launch once min_batch finals are parked (at most
        max_batch) or the oldest has waited max_wait_ms (`can_launch`); the defaults launch at once.
        cuda_graphs: replay the forward from CUDA graphs (None: on a CUDA device)."""
        if max_batch < 1 or min_batch < 1 or max_wait_ms < 0:
            raise ValueError(f"need max_batch >= 1, min_batch >= 1 and max_wait_ms >= 0, got {max_batch}, "
                             f"{min_batch} and {max_wait_ms}")
        self.aligner = aligner
        self.max_batch = max_batch
        self.min_batch = min(min_batch, max_batch)
        self.max_wait_s = max_wait_ms / 1e3
        on_cuda = aligner.device.type == "cuda"
        self.stream = aligner_stream(aligner.device)  # CUDA's lowest priority; None on a CPU
        use_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        self.graphs = AlignerGraphs(aligner, max_rows=max_batch, capture=True) if use_graphs else None
        self._parked: list[Parked] = []
        self._in_flight: InFlight | None = None
        self.num_batches = 0  # forwards launched
        self.num_graphed = 0  # of them, replayed from graphs (the others ran eagerly)
        self.num_rows = 0  # finals aligned (with words or a reason)
        self.launch_seconds = 0.0  # the engine thread's time in launch(): the host's share of alignment
        self.park_seconds = 0.0  # the engine thread's time in park(): splitting and tokenizing the words

    def __len__(self) -> int:
        """Finals parked, not yet launched."""
        return len(self._parked)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight.finals) if self._in_flight is not None else 0

    def has_work(self) -> bool:
        return bool(self._parked) or self._in_flight is not None

    def park(self, seq: Sequence, result: DecodeResult) -> None:
        """Hold a decoded final until its word times are known. Its words are split and tokenized now, host work
        that launch() then does not do; a final that cannot be aligned (its language, no words) is finished at once
        with its reason, without waiting for a launch."""
        start = time.perf_counter()
        item = self._prepare(result)
        parked = Parked(seq, result, start, item)
        if item is None or item.reason is not None:
            self._finish(parked, (), item.reason if item is not None else FAILED_REASON)
        else:
            self._parked.append(parked)
        self.park_seconds += time.perf_counter() - start

    def can_launch(self, idle: bool = False) -> bool:
        """Finals are parked, no batch is in flight (the bound: one batch of at most max_batch at a time), and the
        batch is due: the engine is idle (nothing decodes, so a launch delays no decode step), or min_batch finals
        are parked, or the oldest has waited max_wait_ms. Fewer, fuller forwards: each launch costs the engine
        thread its host part and the decode steps beside it some of the GPU, nearly whatever its size (the aligner's
        forward takes about as long for 8 finals as for 1 on the H200: docs/benchmarks.md)."""
        if not self._parked or self._in_flight is not None:
            return False
        if idle or len(self._parked) >= self.min_batch:
            return True
        return time.perf_counter() - self._parked[0].parked_at >= self.max_wait_s

    def run(self) -> int:
        """Launch a batch and wait for it: the synchronous path (offline use, tests) -> finals finished."""
        self.launch()
        return self.poll(wait_s=math.inf)

    # -- launch ----------------------------------------------------------------------------------------------------

    def launch(self) -> int:
        """Take the oldest `max_batch` parked finals and queue their forward -> how many finals it finished at once
        (whether the batch is due is `can_launch`'s question: this launches whenever one can be in flight).

        A final cancelled meanwhile is finished with CancelledError. If the host's part or the launch fails, the
        finals still complete, with no words and a reason. On CUDA nothing here waits for the device: the clips and
        the layout cross in one pinned, asynchronous copy each (qasr.model.aligner), and the result comes back the
        same way, read by poll() once its event has completed (tests/engine/test_aligner_runner.py checks launch()
        makes no read that would block)."""
        if not self._parked or self._in_flight is not None:
            return 0
        start = time.perf_counter()
        taken, self._parked = self._parked[: self.max_batch], self._parked[self.max_batch :]
        finished, finals, inputs = 0, [], []
        for parked in taken:
            if parked.seq.cancelled:
                parked.seq.finish(asyncio.CancelledError())
                finished += 1
            else:
                finals.append(parked)
                inputs.append(parked.item)
        if finals:
            try:
                self._in_flight = self._launch(finals, inputs)
                self.num_batches += 1
            except Exception:  # the decode is good: never lose a final because its word times failed
                log.exception("launching the alignment of %d finals failed", len(finals))
                for parked in finals:
                    self._finish(parked, (), FAILED_REASON)
                finished += len(finals)
        self.launch_seconds += time.perf_counter() - start
        return finished

    def _prepare(self, result: DecodeResult) -> "AlignerInput | None":
        try:
            return self.aligner.prepare(result.text, result.language or None)
        except Exception:
            log.exception("preparing a final's text for the aligner failed")
            return None

    def _launch(self, finals: list[Parked], inputs: list["AlignerInput"]) -> InFlight:
        audios = [parked.seq.request.audio for parked in finals]
        batch = self.aligner.plan(audios, inputs)
        shape = self.graphs.shape_for(batch) if self.graphs is not None else None
        if shape is not None:
            batch = batch.padded(*shape, pad_id=self.aligner.tokenizer.endoftext_id)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            clips = self.aligner.upload_clips(audios)
            if shape is not None:
                classes = self.graphs.run(batch, clips)
                self.num_graphed += 1
            else:
                classes = self.aligner.forward(batch, clips).argmax(dim=-1)
            if self.stream is None:
                return InFlight(finals, inputs, batch, classes, None)
            host = torch.empty(classes.shape, dtype=classes.dtype, pin_memory=True)
            host.copy_(classes, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return InFlight(finals, inputs, batch, host, done)

    # -- poll ------------------------------------------------------------------------------------------------------

    def poll(self, wait_s: float = 0.0) -> int:
        """Finish the batch in flight if its forward has completed (waiting up to `wait_s` for it) -> finals
        finished. A device error surfacing here fails the batch's word times, not its finals."""
        flight = self._in_flight
        if flight is None:
            return 0
        segment_ms = self.aligner.config.timestamp_segment_ms
        try:
            if not _completed(flight.done, wait_s):
                return 0
            rows = flight.batch.read_classes(flight.classes.numpy())
            answers = [(clamped(word_times(item.words, row, segment_ms), _seconds(parked)), None)
                       for parked, item, row in zip(flight.finals, flight.inputs, rows)]
        except Exception:
            log.exception("aligning %d finals failed", len(flight.finals))
            answers = [((), FAILED_REASON)] * len(flight.finals)
        self._in_flight = None
        for parked, (words, reason) in zip(flight.finals, answers):
            self._finish(parked, words, reason)
        return len(flight.finals)

    def _finish(self, parked: Parked, words: tuple[WordTime, ...], reason: str | None) -> None:
        if parked.seq.cancelled:
            parked.seq.finish(asyncio.CancelledError())
            return
        self.num_rows += 1
        result = parked.result
        timings = dict(result.timings, align_ms=(time.perf_counter() - parked.parked_at) * 1e3)
        parked.seq.finish(replace(result, words=words, words_reason=reason if not words else None, timings=timings))

    def fail_all(self, error: BaseException) -> None:
        """Finish every parked and in-flight final with `error` (the engine is stopping)."""
        parked, self._parked = self._parked, []
        if self._in_flight is not None:
            parked, self._in_flight = self._in_flight.finals + parked, None
        for item in parked:
            item.seq.finish(error)


def _completed(done: torch.cuda.Event | None, wait_s: float) -> bool:
    """Whether the device work before `done` has finished, checking every POLL_SLEEP_S for up to `wait_s`."""
    if done is None:
        return True
    deadline = time.perf_counter() + wait_s
    while not done.query():
        if time.perf_counter() >= deadline:
            return False
        time.sleep(POLL_SLEEP_S)
    return True


def _seconds(parked: Parked) -> float:
    return len(parked.seq.request.audio) / SAMPLE_RATE


def clamped(words, seconds: float) -> tuple[WordTime, ...]:
    """(word, start, end) triples as WordTimes inside [0, seconds] (seconds: the clip's length, to the ms)."""
    limit = math.floor(seconds * 1000) / 1000
    return tuple(WordTime(word, min(start, limit), min(end, limit)) for word, start, end in words)
