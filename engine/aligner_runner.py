"""Word times for the finals that asked: the forced aligner run after their decode, beside it, many finals per forward.

A final whose request has `words=True` is not handed out when its decode stops: the engine parks it here with its
result. `launch()` takes up to `max_batch` parked finals, does the host's part (split and tokenize the words, lay the
batch out: qasr.model.aligner_batch), and queues the forward (qasr.model.aligner: mel, encoder windows of all clips
packed, one causal pass, argmax at every position) on a CUDA stream of its own, replaying CUDA graphs
(qasr.engine.aligner_graphs) when the batch fits a bucket; then it records an event and returns. The engine keeps
decoding on its stream meanwhile, at a higher priority when it decodes on qasr.engine.streams' `decode_stream()`: the
aligner's stream has CUDA's lowest priority, so the GPU schedules a decode step's blocks before the aligner's
waiting ones. The aligner needs nothing the decode stream makes (its own mel and encoder, from the request's audio on
the host), so no event joins the two streams. `poll()`, called every engine step, finishes the batch once its event has
completed: it reads the small [rows, tokens] class tensor, repairs each row's times (the monotonic repair) and hands
the finals out. One batch is in flight at a time (the graphs' static buffers are its inputs), of at most `max_batch`
finals (EngineOptions.aligner_max_batch): that bounds the aligner's share of the GPU at any moment; finals that stop
meanwhile wait for the next launch, which comes only once the one in flight is done. Finals that did not ask never
come here and never wait. On the CPU (tests, small deployments) the same calls run the forward synchronously:
`launch()` then `poll()` completes at once.

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

    def __init__(self, aligner: "ForcedAligner", *, max_batch: int = 32, cuda_graphs: bool | None = None):
        """cuda_graphs: replay the forward from CUDA graphs (None: on a CUDA device)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.aligner = aligner
        self.max_batch = max_batch
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

    def __len__(self) -> int:
        """Finals parked, not yet launched."""
        return len(self._parked)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight.finals) if self._in_flight is not None else 0

    def has_work(self) -> bool:
        return bool(self._parked) or self._in_flight is not None

    def park(self, seq: Sequence, result: DecodeResult) -> None:
        """Hold a decoded final until its word times are known."""
        self._parked.append(Parked(seq, result, time.perf_counter()))

    def can_launch(self) -> bool:
        """Finals are parked and no batch is in flight (the bound: one batch of at most max_batch at a time)."""
        return bool(self._parked) and self._in_flight is None

    def run(self) -> int:
        """Launch a batch and wait for it: the synchronous path (offline use, tests) -> finals finished."""
        self.launch()
        return self.poll(wait_s=math.inf)

    # -- launch ----------------------------------------------------------------------------------------------------

    def launch(self) -> int:
        """Take the oldest `max_batch` parked finals and queue their forward -> how many finals it finished at once.

        A final cancelled meanwhile is finished with CancelledError; one whose text cannot be aligned (its language,
        no words) gets its reason now. If the host's part or the launch fails, the finals still complete, with no
        words and a reason."""
        if not self.can_launch():
            return 0
        start = time.perf_counter()
        taken, self._parked = self._parked[: self.max_batch], self._parked[self.max_batch :]
        finished, finals, inputs = 0, [], []
        for parked in taken:
            if parked.seq.cancelled:
                parked.seq.finish(asyncio.CancelledError())
                finished += 1
                continue
            item = self._prepare(parked)
            if item is None or item.reason is not None:
                self._finish(parked, (), item.reason if item is not None else FAILED_REASON)
                finished += 1
            else:
                finals.append(parked)
                inputs.append(item)
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

    def _prepare(self, parked: Parked) -> "AlignerInput | None":
        try:
            return self.aligner.prepare(parked.result.text, parked.result.language or None)
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
