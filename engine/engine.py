"""The engine: continuous batching of many streams' requests on one model.

`Engine.step()` is schedule -> run -> postprocess, as in nano-vllm: the `Scheduler` picks what runs (waiting and
running sequences, slots), the `ModelRunner` is the only caller of the model (mel, encoder, prefill, decode), and
`postprocess` decides which sequences stop and what they said. What stays here is the orchestration: the stream cache
(encoder windows and KV prefixes a stream's next partial reuses, its last answer), the admission interval and the
metrics. `AsyncEngine` runs the loop on its own thread and hands results to asyncio futures; the event loop never
waits on the GPU and the GPU never waits on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from dataclasses import dataclass

import torch

from qasr.model import audio as qaudio
from qasr.model.checkpoint import load_model, resolve_model_dir
from qasr.model.modeling import Qwen3ASR
from qasr.model.prompt import PromptTemplates
from qasr.model.tokenizer import Tokenizer

from . import postprocess, prompting
from .futures import settle
from .aligner_runner import AlignerRunner
from .audio_frontend import AudioFrontEnd
from .options import EngineOptions, display_name
from .request import DecodeRequest, DecodeResult, EngineClosed, EngineCrashed, Priority
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .stream_cache import StreamCache, StreamState
from .streams import admission_stream, decode_stream, on_own_stream

__all__ = ["AsyncEngine", "Engine", "EngineOptions", "display_name"]

log = logging.getLogger(__name__)

IDLE_ALIGNMENT_WAIT_S = 0.002  # an idle engine waits this long for an alignment in flight, then looks for new work


def _moving_average(average: float | None, value: float, weight: float = 0.2) -> float:
    return value if average is None else average + weight * (value - average)


@dataclass
class _Prepared:
    """An admission's host work, done while a decode step ran: the sequences that fit (their prompts built), their
    audio front end's host part, and the streams running when it was scheduled."""

    seqs: list[Sequence]
    clips: list | None  # AudioFrontEnd.prepare's answer
    busy: set[str]
    started: float  # perf_counter when the admission began (the end of the sequences' queue delay)


@dataclass
class _Admitted:
    """An admission whose device work (encoder, prefill) is queued on the admission stream: its rows start decoding
    once `done` (a CUDA event recorded after the prefill; None: done at once, off CUDA)."""

    seqs: list[Sequence]  # in the prefill's order: that of `first`
    first: torch.Tensor  # their first tokens, on the device
    done: "torch.cuda.Event | None"

    def ready(self) -> bool:
        return self.done is None or self.done.query()


@dataclass
class _Launch:
    """A decode launch not read yet: its number (the runner's) and the rows whose first tokens its read brings."""

    number: int
    first: list[Sequence]


def device_memory(device: torch.device) -> dict[str, float]:
    """The CUDA caching allocator's work so far on `device`: cudaMalloc and cudaFree calls (each can hold the thread
    that made it: session 9 found the engine thread inside C++ calls most of an admission), retries after a failed
    allocation (each frees the cache, synchronizing), and the bytes reserved and allocated now."""
    stats = torch.cuda.memory_stats(device)
    return {"device_allocs": stats.get("num_device_alloc", 0), "device_frees": stats.get("num_device_free", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
            "allocated_bytes": stats.get("allocated_bytes.all.current", 0)}


class Engine:
    """Synchronous core. `add()` and `release_stream()` are thread-safe; `step()` must be called from one thread."""

    def __init__(self, model: Qwen3ASR, tokenizer: Tokenizer, options: EngineOptions = EngineOptions(), name: str = "",
                 aligner=None):
        """aligner: a qasr.model.aligner.ForcedAligner on the model's device, for finals that ask for word times."""
        self.model = model  # for building other engines on the same weights: only the runner calls it
        self.tokenizer, self.options = tokenizer, options
        self.prompts = PromptTemplates(tokenizer)  # the tokenized template per (context, language)
        self.model_name = name
        self.eos_ids = () if options.ignore_eos else tokenizer.eos_ids
        self.runner = ModelRunner(
            model,
            num_slots=options.num_slots,
            max_len=options.max_len,
            num_retained=options.num_retained,
            eos_ids=self.eos_ids,
            cuda_graphs=options.cuda_graphs,
            fused_kernels=options.fused_kernels,
            kv_int8=options.kv_int8,
            fp8_prefill=options.fp8_prefill,
            fp8_encoder=options.fp8_encoder,
            fp8_lm_head=options.fp8_lm_head,
        )
        self.scheduler = Scheduler(options.num_slots)
        self.aligner = (AlignerRunner(aligner, max_batch=options.aligner_max_batch, min_batch=options.aligner_min_batch,
                                      max_wait_ms=options.aligner_max_wait_ms, cuda_graphs=options.cuda_graphs)
                        if aligner is not None else None)
        self._last_alignment = -math.inf
        # step() decodes here, above the admissions' and the aligner's streams in priority (None: the thread's
        # current stream); an admission's device work goes to its own stream (None: the decode stream's)
        self.stream = decode_stream(self.runner.device) if options.stream_priorities else None
        self.admission_stream = admission_stream(self.runner.device) if options.stream_priorities else None
        self._admitted: list[_Admitted] = []  # admissions whose rows wait for their device work to start decoding
        # queue an admission's device work while the decode step runs, not after its read: on a stream of its own,
        # its launches (and the wait for its mel's extremes, on that stream) overlap the step instead of leaving the
        # GPU without a step meanwhile. Without one the mel's read would wait for the step: after the read, as before
        self.admit_during_step = self.admission_stream is not None
        # a lone admission's rows may start at once, the decode stream waiting for its prefill on the device
        # (_starts_on_device_wait; benchmarks that time the steps alone turn it off)
        self.lone_admission_waits_on_device = True
        self.streams = StreamCache(range(options.num_slots, options.num_slots + options.num_retained))
        self._lock = threading.Lock()  # guards the stream cache's release from other threads
        self._released: list[str] = []
        self.recent_batch_sizes: collections.deque[int] = collections.deque(maxlen=64)  # for metrics
        self.steps = 0
        self._last_admission = -math.inf
        # how long (s) a decode step alone and an admission's host work beside one have been taking (moving
        # averages): how many steps to queue beside the next admission (_steps_beside_admission)
        self._step_s: float | None = None
        self._admission_host_s: float | None = None
        self._first_unread: list[Sequence] = []  # admitted, their first token on the device: read with the next step
        # decode launches not read yet, oldest first: with run-ahead one stays queued while the host works on the last
        self.run_ahead = options.decode_run_ahead
        self._unread: collections.deque[_Launch] = collections.deque()
        self._scheduled: list[Sequence] = []  # taken from the queue by an admission not done yet (fail_all's too)
        # cumulative work, to measure what partials reuse: prompt positions prefilled vs copied from a retained
        # prefix, encoder windows computed vs kept from a stream's earlier partial
        # decode_rows / steps is the mean decode batch
        self.counters = {"prefill_tokens": 0, "reused_tokens": 0, "encoded_windows": 0, "reused_windows": 0,
                         "mel_frames": 0, "conv_chunks": 0, "decode_rows": 0, "prefill_computed_tokens": 0,
                         "decode_launches": 0,  # steps / decode_launches: the steps queued together, on average
                         "admissions": 0, "admissions_alone": 0}  # all, and those with nothing else decoding (the
        # GPU idle through their host work: an offline run's wave ends)
        self.frontend = AudioFrontEnd(self.runner, self.counters)  # mel + encoder, a partial's only for what is new
        # where the engine thread's time goes (wall seconds): admissions (encode + prefill), decode steps (launch and
        # wait for the GPU), the host's per-row work after each step, and (AsyncEngine) waiting for work. Their
        # rates under load say whether the GPU, the engine's Python or something outside it (the event loop) bounds
        # a server.
        self.seconds = {"admit": 0.0, "decode_gpu": 0.0, "decode_host": 0.0, "align": 0.0, "idle": 0.0}
        self._device_memory_read: tuple[float, dict] = (-math.inf, {})  # (when, device_memory then)
        self.thread_cpu_seconds = 0.0  # CPU the engine thread used (AsyncEngine): near its busy wall time means the
        # thread runs Python, not waits on the GPU

    @classmethod
    def from_pretrained(cls, model: str, *, device=None, dtype=None, options: EngineOptions = EngineOptions()):
        model_dir = resolve_model_dir(model)
        qwen = load_model(model_dir, device=device, dtype=dtype)
        aligner = None
        if options.aligner is not None:
            from qasr.model.aligner import ForcedAligner

            aligner = ForcedAligner.from_pretrained(options.aligner, device=qwen.device, dtype=qwen.dtype)
        return cls(qwen, Tokenizer.from_pretrained(model_dir), options, name=display_name(model), aligner=aligner)

    # -- submitting ------------------------------------------------------------------------------------------------

    def add(self, request: DecodeRequest, on_done) -> Sequence:
        """Queue a request; `on_done(result or exception)` is called once, on the engine thread (or here on error)."""
        seq = Sequence(request, on_done)
        try:
            prompting.validate(request, self.options)
            self._check_words(request)
        except ValueError as e:
            seq.finish(e)
            return seq
        self.scheduler.add(seq)
        return seq

    def _check_words(self, request: DecodeRequest) -> None:
        if not request.words:
            return
        if self.aligner is None:
            raise ValueError("word times need a forced aligner and this engine has none (qasr-server --aligner)")
        if request.priority is not Priority.FINAL:
            raise ValueError("word times are given on finals only, not on partials")

    def check_context(self, context: str, *, language: str | None = None, max_audio_seconds: float) -> None:
        prompting.check_context(self.tokenizer, self.options, context, language=language,
                                max_audio_seconds=max_audio_seconds)

    def release_stream(self, stream_id: str) -> None:
        """Forget a stream's cached windows, retained KV and last answer (thread-safe; applied before the next step)."""
        with self._lock:
            self._released.append(stream_id)

    # -- the loop --------------------------------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Is anything left to step for: requests (has_requests), or a launch still to read?"""
        return self.has_requests() or bool(self._unread)

    def has_requests(self) -> bool:
        """Is a request added still without its result (queued, decoding, or waiting for its word times)?"""
        return (bool(self.scheduler.running) or len(self.scheduler) > 0
                or (self.aligner is not None and self.aligner.has_work()))

    overlap_admissions = True  # False: admit, then decode, as before the overlap (the tests compare the two)

    @torch.inference_mode()
    @on_own_stream
    def step(self) -> None:
        """Admit (when due) and decode. While rows decode, an admission overlaps the decode steps (_decode: one, or
        as many as fit in its host work's time): they are launched first (a graph's replay returns at once), the
        admission's host work (scheduling, prompts, the audio front end's bookkeeping and staging) runs while the
        device decodes, and its device work is queued (on CUDA during the steps, on the admission stream; elsewhere
        after their read). Its rows decode from the first
        step after that work is done (`_start_admitted`). Each row's tokens depend only on its own inputs (identical
        inputs give identical rows), so the order changes when rows run, not what they say. With nothing decoding,
        the admission runs whole and its rows decode in this step."""
        self._apply_releases()
        self._drop_cancelled()
        self._start_admitted(wait=not self._decoding())
        admitting = self.scheduler.can_admit() and self._admission_due() and not self._admitted
        if admitting:
            self.counters["admissions"] += 1
        if admitting and not (self.overlap_admissions and self.scheduler.running):
            start = time.perf_counter()
            self.counters["admissions_alone"] += not self.scheduler.running
            self._admit()
            self._start_admitted(wait=True)  # nothing else decodes: its rows decode in this step
            self._last_admission = time.perf_counter()  # the interval counts from the end: decoding gets it whole
            self.seconds["admit"] += self._last_admission - start
            admitting = False
        if self.scheduler.running or self._unread:
            self._decode(admitting)
        if self.aligner is not None:
            self._align()

    def _align(self) -> None:
        """Finish the alignment in flight if it is done; launch the next one when due. Both return at once: the
        aligner runs on its own stream while decoding goes on (aligner_runner.py). With nothing else to do, wait a
        little for the batch in flight instead of spinning."""
        start = time.perf_counter()
        idle = not self.scheduler.running and len(self.scheduler) == 0
        self.aligner.poll(wait_s=IDLE_ALIGNMENT_WAIT_S if idle and not self.aligner.can_launch(idle=True) else 0.0)
        if self.aligner.can_launch(idle=not self.scheduler.running) and self._alignment_due():
            self.aligner.launch()
            self._last_alignment = time.perf_counter()
            self.aligner.poll()  # on the CPU the forward ran in launch(): its finals go out in this step
        self.seconds["align"] += time.perf_counter() - start

    def _admission_due(self) -> bool:
        """Admit at once when nothing decodes; otherwise batch arrivals into one admission per interval of decoding."""
        interval = self.options.admission_interval_ms / 1e3
        return not self.scheduler.running or time.perf_counter() - self._last_admission >= interval

    def _alignment_due(self) -> bool:
        """As admissions: at once when nothing decodes; otherwise the finals that stopped during one interval of
        decoding share a forward (finals that did not ask for words never wait for it)."""
        interval = self.options.admission_interval_ms / 1e3
        return not self.scheduler.running or time.perf_counter() - self._last_alignment >= interval

    def run_until_done(self) -> None:
        """Step until every request added has its result. With run-ahead a launch queued before the last rows
        finished may still be on the device, with no row in it: the next step reads it, and the results come back
        without waiting for it (one step of a 40-token clip's 40)."""
        while self.has_requests():
            self.step()

    def drain(self) -> None:
        """run_until_done, then read the launches still queued: before driving the runner directly (the benches)."""
        while self.has_work():
            self.step()

    def transcribe(self, requests: list[DecodeRequest]) -> list[DecodeResult]:
        """Offline use: run `requests` to completion on this thread (batched as slots allow), results in order."""
        results: list = [None] * len(requests)
        for i, req in enumerate(requests):
            self.add(req, lambda r, i=i: results.__setitem__(i, r))
        self.run_until_done()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def stats(self) -> dict:
        return {
            "queue": self.scheduler.depths(),
            "running": len(self.scheduler.running),
            "free_slots": self.scheduler.num_free_slots,
            "streams_cached": len(self.streams),
            "steps": self.steps,
            "batch_sizes": list(self.recent_batch_sizes),
            "counters": dict(self.counters),
            "host_reads": self.runner.host_reads,
            "prompt_templates": {"hits": self.prompts.hits, "misses": self.prompts.misses},
            **({"aligner": {"parked": len(self.aligner), "in_flight": self.aligner.num_in_flight,
                            "batches": self.aligner.num_batches, "graphed": self.aligner.num_graphed,
                            "rows": self.aligner.num_rows, "launch_seconds": self.aligner.launch_seconds}}
               if self.aligner is not None else {}),
            "seconds": dict(self.seconds),
            "thread_cpu_seconds": self.thread_cpu_seconds,
            **({"device_memory": self._device_memory()} if self.runner.device.type == "cuda" else {}),
        }

    def _device_memory(self) -> dict[str, float]:
        """device_memory, read at most once a second: with --engine-in-process the pool asks for stats a few times
        a handshake, on the event loop, and the allocator's full statistics are a few hundred entries."""
        now = time.monotonic()
        if now - self._device_memory_read[0] >= 1.0:
            self._device_memory_read = (now, device_memory(self.runner.device))
        return self._device_memory_read[1]

    # -- admit: schedule, encode, prefill, postprocess the first tokens ---------------------------------------------

    def _admit(self) -> None:
        seqs, prepared = self._prepare_admission()
        if seqs:
            self._admit_apart(seqs, prepared)

    def _prepare_admission(self) -> tuple[list[Sequence], _Prepared | None]:
        """The host half of an admission (while a decode step runs, or with nothing decoding) -> the sequences
        scheduled and their preparation (None if it raised: the admission then does it all again, and a request that
        cannot be prepared fails alone there)."""
        seqs = self.scheduler.schedule(self.options.max_prefill_tokens, lambda seq: prompting.prefill_cost(seq.request))
        if not seqs:
            return seqs, None
        try:
            return seqs, self._prepare(seqs)
        except Exception:
            log.warning("preparing an admission failed: prepared again as it is admitted", exc_info=True)
            return seqs, None

    def _prepare(self, seqs: list[Sequence]) -> _Prepared:
        """Prompts and the audio front end's host part for `seqs`; a request whose prompt cannot fit, or whose audio
        is not all finite, is finished with its error here (it alone)."""
        started = time.perf_counter()
        busy = self.scheduler.running_streams()
        fitting = []
        for seq in seqs:
            frames = qaudio.num_frames(seq.request.audio.size)
            try:
                seq.prompt, seq.budget = prompting.prepare_prompt(
                    self.prompts, self.options, seq.request, int(qaudio.num_audio_tokens(frames)),
                    self._rolled_back_answer(seq))
            except ValueError as e:  # this request only
                seq.finish(e)
                continue
            fitting.append(seq)
        clips = self._prepare_audio(fitting)
        if clips and not all(clip.finite for clip in clips):  # those requests fail alone; the rest staged again
            for seq, clip in zip(fitting, clips):
                if not clip.finite:
                    seq.finish(ValueError("audio contains NaN or infinite samples"))
            fitting = [seq for seq, clip in zip(fitting, clips) if clip.finite]
            clips = self._prepare_audio(fitting)
        return _Prepared(fitting, clips, busy, started)

    def _prepare_audio(self, seqs: list[Sequence]) -> list | None:
        if not seqs:
            return None
        return self.frontend.prepare([seq.request.audio for seq in seqs], [self._stream_state(seq) for seq in seqs])

    def _admit_apart(self, seqs: list[Sequence], prepared: _Prepared | None = None, after=None) -> None:
        """Admit `seqs` together; if that raises, each on its own, so that a request the encoder or the prefill cannot
        take (bad shapes, a fault of its own) fails alone and its batch mates run as if it had not been there.
        prepared: their host work, done already (while a decode step ran). after: see _admit_scheduled."""
        try:
            self._admit_together(seqs, prepared, after)
        except Exception as error:
            left = self._undo_admission(seqs)
            if len(seqs) > 1:
                log.warning("admitting %d requests together failed: admitting each on its own", len(seqs),
                            exc_info=True)
                for seq in left:
                    self._admit_apart([seq])
                return
            log.exception("a request failed in the engine")
            for seq in left:
                seq.finish(error)
            if self.runner.device.type == "cuda":  # a broken CUDA context fails everything: raise it, so the
                torch.cuda.synchronize(self.runner.device)  # engine stops (and its process is restarted)

    def _undo_admission(self, seqs: list[Sequence]) -> list[Sequence]:
        """After a failed admission: free the slots it took, and forget the partials' stream state (it may be half
        updated) -> the sequences still to be finished."""
        left = [seq for seq in seqs if seq.status is not Status.FINISHED and not seq.finish_reason]
        placed = [seq.slot for seq in left if seq.slot >= 0]
        for seq in left:
            self.scheduler.release(seq)
            seq.slot = -1
            if seq.request.priority is Priority.PARTIAL and seq.stream_id is not None:
                self.streams.release(seq.stream_id)
        self.runner.stop_rows(placed)
        return left

    def _admit_together(self, seqs: list[Sequence], prepared: _Prepared | None = None, after=None) -> None:
        """The admission's device work (and its host work first, unless `prepared`): encode, prefill, and the rows
        started with their first tokens left on the device (read with the next decode step's output).
        after: see _admit_scheduled."""
        if prepared is None:
            prepared = self._prepare(seqs)
        t0 = prepared.started
        self._order_after_decoding(after)
        seqs, embeds, starts = self._encode(prepared)
        if not seqs:
            return
        t1 = time.perf_counter()
        slots = [self.scheduler.place(seq) for seq in seqs]
        with torch.cuda.stream(self.admission_stream):  # a no-op context off CUDA
            for seq, slot, start in zip(seqs, slots, starts):
                if start:  # copy the stream's retained prompt + audio KV instead of prefilling it again
                    self.runner.copy_prefix(self.streams.peek(seq.stream_id).retained_slot, slot, start)
            first = self.runner.prefill([e[s:] for e, s in zip(embeds, starts)], slots, starts)
            self._retain_prefixes(seqs, prepared.busy)
            done = self._record_done()
        self.counters["prefill_tokens"] += sum(e.shape[0] - s for e, s in zip(embeds, starts))
        self.counters["prefill_computed_tokens"] += first.computed  # the prefill tokens and their buckets' padding
        self.counters["reused_tokens"] += sum(starts)
        t2 = time.perf_counter()
        for seq in seqs:
            seq.timings.update(queue_ms=(t0 - seq.t_submit) * 1e3, encode_ms=(t1 - t0) * 1e3,
                               prefill_ms=(t2 - t1) * 1e3)
        ordered = [seqs[i] for i in first.order]  # the prefill's order (by length): its tokens' order
        self._admitted.append(_Admitted(ordered, first.tokens, done))

    def _record_done(self) -> "torch.cuda.Event | None":
        """An event on the admission stream after the work queued so far (None off CUDA, or without the stream)."""
        return self._record_event(self.admission_stream)

    def _record_event(self, stream) -> "torch.cuda.Event | None":
        """An event on `stream` after the work queued there so far; None without an admission stream (nothing to
        order against)."""
        if self.admission_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _decoding(self) -> bool:
        """Are rows decoding, besides those whose admission's device work is not done?"""
        waiting = {seq.slot for admitted in self._admitted for seq in admitted.seqs}
        return any(slot not in waiting for slot in self.scheduler.running)

    def _starts_on_device_wait(self) -> bool:
        """May the rows of admissions whose device work is not done start at once, the decode stream waiting for
        their events on the device instead of the host? Only where nothing else decodes (the host would wait for
        them: a host wait left the GPU idle through start_rows' and the first step's launches after it, 1.6 ms
        between the prefill's end and the first decode kernel in session 37's batch-1 trace), only with an
        admission stream (off CUDA there is none, nor a stream to wait on, and the host waits as it always did), and
        where lone_admission_waits_on_device."""
        return self.lone_admission_waits_on_device and self.admission_stream is not None and not self._decoding()

    def _start_admitted(self, wait: bool) -> None:
        """Put the rows of every admission whose device work is done into decode, on the decode stream (wait: all of
        them, the host waiting for those not done, or with _starts_on_device_wait the decode stream on the device).
        A row cancelled meanwhile (its slot freed) is started and idled again at once."""
        on_device = wait and self._starts_on_device_wait()
        while self._admitted and (wait or self._admitted[0].ready()):
            admitted = self._admitted.pop(0)
            if on_device and not admitted.ready():  # start_rows and the step queued behind the prefill
                torch.cuda.current_stream(self.runner.device).wait_event(admitted.done)
            elif admitted.done is not None:
                admitted.done.synchronize()  # returns at once when ready()
            seqs = admitted.seqs
            self.runner.start_rows([seq.slot for seq in seqs], admitted.first, [seq.prompt.num_tokens for seq in seqs],
                                   [seq.budget for seq in seqs])
            live = [seq for seq in seqs if self.scheduler.running.get(seq.slot) is seq]
            self.runner.stop_rows([seq.slot for seq in seqs if self.scheduler.running.get(seq.slot) is not seq])
            now = time.perf_counter()
            for seq in live:
                seq.t_decode = now
                seq.first_launch = self.runner.launches  # the next launch: one queued already ran without it
            self._first_unread += live

    def _order_after_decoding(self, after=None) -> None:
        """Work queued on the admission stream from now on runs after what the decode stream queued (start_rows of
        the admission before, whose first tokens' memory it may reuse; stop_rows of slots it may fill), or after
        `after` (a decode-stream event recorded before a step launched since, which it need not wait for)."""
        stream = self.admission_stream
        if stream is None:
            return
        if after is None:
            stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        else:
            stream.wait_event(after)

    def _encode(self, prepared: _Prepared) -> tuple[list[Sequence], list[torch.Tensor], list[int]]:
        """Mel + encoder for the prepared sequences (a stream's partial only what is new; see audio_frontend.py),
        on the admission stream -> prompt embeddings.

        Returns the sequences (those whose prompt fit), each one's full prompt embeddings [T, D], and how many
        leading positions can be copied from a retained KV prefix.
        """
        fitting = prepared.seqs
        if not fitting:
            return [], [], []
        with torch.cuda.stream(self.admission_stream):  # a no-op context off CUDA
            embedded = self.frontend.run(prepared.clips)
            embeds = self.runner.embed_prompts([seq.prompt for seq in fitting], [e.windows for e in embedded])
        starts = [self._reusable_positions(seq, e.kept_windows) for seq, e in zip(fitting, embedded)]
        return fitting, embeds, starts

    # -- what a stream keeps between its partials ------------------------------------------------------------------

    def _stream_state(self, seq: Sequence) -> StreamState | None:
        """Partials of a stream share cached state; finals never read it (they must equal offline decoding)."""
        if seq.request.priority is Priority.PARTIAL and seq.stream_id is not None:
            return self.streams.get(seq.stream_id)
        return None

    def _rolled_back_answer(self, seq: Sequence) -> tuple[int, ...]:
        """A partial's given prefix: its stream's previous partial's answer minus the last `rollback_tokens`."""
        state = self._stream_state(seq)
        if state is None or not self.options.rollback_tokens:
            return ()
        return state.answer_ids[: max(0, len(state.answer_ids) - self.options.rollback_tokens)]

    def _reusable_positions(self, seq: Sequence, windows: int) -> int:
        state = self._stream_state(seq)
        if state is None or state.retained_slot < 0 or state.prefix_ids != seq.prompt.prefix_ids:
            return 0
        n = min(windows, state.kv_windows)
        return len(seq.prompt.prefix_ids) + n * qaudio.WINDOW_TOKENS if n > 0 else 0

    def _retain_prefixes(self, seqs: list[Sequence], busy: set[str]) -> None:
        """After prefill: keep each partial's prompt prefix + whole-window audio KV for the stream's next partial.
        busy: the streams running when the admission was scheduled (their retained KV is not taken)."""
        busy = busy | {seq.stream_id for seq in seqs if seq.stream_id}
        for seq in seqs:
            state = self._stream_state(seq)
            if state is None or not state.windows:
                continue
            slot = self.streams.retained_slot(seq.stream_id, busy)
            if slot < 0:
                continue
            length = len(seq.prompt.prefix_ids) + len(state.windows) * qaudio.WINDOW_TOKENS
            self.runner.copy_prefix(seq.slot, slot, length)
            state.prefix_ids, state.kv_windows = seq.prompt.prefix_ids, len(state.windows)

    # -- decode and postprocess ------------------------------------------------------------------------------------

    def _decode(self, admitting: bool = False) -> None:
        """Decode steps; admitting: an admission is due, its host work done while they run (see step), beside as many
        steps as it has been taking time for (the graphs feed themselves), so that the decode stream does not idle
        through the rest of it. With run-ahead the launch made here is read by the next call (one launch stays
        queued while the host works on the one before it); with no rows running nothing is launched, and what is
        still queued is read."""
        running = self.scheduler.running
        steps = self._steps_beside_admission() if admitting else 1
        during = admitting and self.admit_during_step
        # what the decode stream queued so far (rows started and stopped): the admission waits for that, not the step
        before_step = self._record_event(self.stream) if during else None
        t0 = time.perf_counter()
        launched = bool(running)
        if launched:
            self._count_rows(len(running))
            first, self._first_unread = self._first_unread, []
            number = self.runner.launch_decode(max(running) + 1, read_tokens=bool(first), steps=steps)
            self._unread.append(_Launch(number, first))
            self.steps += steps
            self.counters["decode_launches"] += 1
        t1 = time.perf_counter()
        seqs, prepared = self._prepare_admission() if admitting else ([], None)
        self._scheduled = seqs  # neither waiting nor running until admitted: if the step fails, fail_all finishes them
        if during:
            self._admit_scheduled(seqs, prepared, after=before_step)
        t2 = time.perf_counter()
        keep = 1 if launched and self.run_ahead else 0
        waited, reads = 0.0, 0
        while len(self._unread) > keep:
            reads += 1
            t3 = time.perf_counter()
            launch = self._unread.popleft()
            out, fed = self.runner.read_decode()
            waited += time.perf_counter() - t3
            self._take_first_tokens(launch.first, fed)
            for i, step_out in enumerate(out.numpy()):  # in order: a row one step finished is not running in the next
                if i:
                    self._count_rows(len(self.scheduler.running))
                self._postprocess(step_out, launch.number)
        t4 = time.perf_counter()
        self.seconds["decode_gpu"] += (t1 - t0) + waited
        self.seconds["admit"] += t2 - t1
        self.seconds["decode_host"] += t4 - t2 - waited
        if admitting:
            self._admission_host_s = _moving_average(self._admission_host_s, t2 - t1)
        # a step's time, for the steps to queue beside an admission: on CUDA the device's, from its launch's events
        # (with run-ahead the host waits only for the rest of a step launched one call before), else the host's
        if self.runner.last_step_s is not None:
            if reads:
                self._step_s = _moving_average(self._step_s, self.runner.last_step_s)
        elif launched and not admitting:
            self._step_s = _moving_average(self._step_s, t1 - t0 + waited)
        if admitting and not during:
            self._admit_scheduled(seqs, prepared)
            self.seconds["admit"] += self._last_admission - t4

    def _count_rows(self, rows: int) -> None:
        """A decode step's rows, for the mean batch (decode_rows / steps) and the pool's headroom."""
        self.recent_batch_sizes.append(rows)
        self.counters["decode_rows"] += rows

    def _steps_beside_admission(self) -> int:
        """Steps to queue beside the next admission's host work: about as many as fit in the time that has been
        taking (1 until both are measured), at most options.decode_steps_ahead; 1 off CUDA, where a step runs
        whole before the host goes on. A row that ends in an early one is finished there: the device idles rows at
        their EOS or budget itself; one the host stops (repetition) decodes on, unread, until the stop queued after
        the steps. Its time counts the host's waits inside the admission (the mel's extremes) too."""
        most = self.options.decode_steps_ahead
        if most == 1 or self.runner.device.type != "cuda" or not self._step_s or self._admission_host_s is None:
            return 1
        return max(1, min(most, round(self._admission_host_s / self._step_s)))

    def _admit_scheduled(self, seqs: list[Sequence], prepared: _Prepared | None, after=None) -> None:
        """Admit what `_prepare_admission` scheduled. after: a decode-stream event the admission's device work
        waits for (None: all the decode stream queued so far)."""
        if seqs:
            self._admit_apart(seqs, prepared, after)
        self._scheduled = []
        self._last_admission = time.perf_counter()

    def _take_first_tokens(self, started: list[Sequence], fed) -> None:
        """The first tokens of the rows started before a launch (fed to its first step): record each, finish those
        it ends (their rows were left idle on the device, see ModelRunner.start_rows), before its steps' tokens."""
        if fed is None:
            return
        fed = fed.numpy()
        done = []
        for seq in started:
            if self.scheduler.running.get(seq.slot) is not seq:  # cancelled meanwhile
                continue
            reason = postprocess.stop_reason(seq, int(fed[seq.slot]), self.eos_ids)
            if reason:
                done.append((seq, reason))
        self._complete_all(done)

    def _postprocess(self, out, launch: int) -> None:
        """out: [2, rows] (token or -1 for an idle row, finished on the device), a step of launch number `launch` ->
        finish what stopped."""
        stopped, done = [], []
        tokens, finished_rows = out.tolist()  # Python ints at once: this loop runs per row per step
        rows = len(tokens)
        window = self.options.repetition_window
        for slot, seq in list(self.scheduler.running.items()):
            if slot >= rows or seq.first_launch is None or seq.first_launch > launch:  # not started, or started
                continue  # after the launch: not in it (its slot's output is the row before's, or idle)
            tok, finished = tokens[slot], finished_rows[slot]
            if tok < 0:
                continue
            reason = postprocess.stop_reason(seq, tok, self.eos_ids, bool(finished))
            if reason is None and postprocess.is_repeating(seq.generated, window):
                stopped.append(slot)  # the device does not know: idle its row
                reason = "repetition"
            if reason:
                done.append((seq, reason))
        self._complete_all(done)
        self.runner.stop_rows(stopped)

    def _complete_all(self, finished: list[tuple[Sequence, str]]) -> None:
        """Release each (sequence, reason)'s slot and give it its result; their texts decoded in one batch (a decode
        a row was 4.7% of the engine thread offline, where a step finishes hundreds of rows together)."""
        if not finished:
            return
        now = time.perf_counter()
        for seq, reason in finished:
            seq.finish_reason = reason
            seq.timings["engine_ms"] = (now - seq.t_submit) * 1e3  # submit to result: the pieces and the gaps
            # between them (admission's front end, the steps before its first decode); align_ms comes after
            self.scheduler.release(seq)
            if seq.request.priority is Priority.PARTIAL and seq.stream_id is not None:
                state = self.streams.peek(seq.stream_id)  # None once released: a late partial does not bring it back
                if state is not None:
                    state.answer_ids = postprocess.answer_ids(seq)
        for (seq, _), result in zip(finished, postprocess.results_of(finished, self.tokenizer)):
            if seq.request.words:
                self.aligner.park(seq, result)  # finished once its word times are known
            else:
                seq.finish(result)

    def _drop_cancelled(self) -> None:
        dropped = self.scheduler.drop_cancelled()
        for seq in dropped:
            seq.finish(asyncio.CancelledError())
        self.runner.stop_rows([seq.slot for seq in dropped])

    def _apply_releases(self) -> None:
        with self._lock:
            released, self._released = self._released, []
        for stream_id in released:
            self.streams.release(stream_id)

    def fail_all(self, error: BaseException) -> None:
        self._first_unread = []
        self._unread.clear()  # nothing will read them
        self.runner.forget_launches()
        self._admitted = []  # their sequences are running (placed): drained below
        scheduled, self._scheduled = self._scheduled, []
        for seq in scheduled:  # finished already if admitted (finish is once)
            seq.finish(error)
        running = list(self.scheduler.running)
        for seq in self.scheduler.drain():
            seq.finish(error)
        if self.aligner is not None:
            self.aligner.fail_all(error)
        self.runner.stop_rows(running)


class AsyncEngine:
    """The engine on its own thread, awaited from asyncio.

    `await transcribe(req)` returns the result; cancelling the awaiting task cancels the work (a queued request is
    dropped, a running one frees its slot at the next step). Raises `Superseded` when a newer partial of the same
    stream replaced a queued one, `EngineClosed` once the engine stops, `EngineCrashed` for what it held when its loop
    failed (it is not restarted: `error` is set and later requests get EngineClosed).
    """

    model_name: str

    def __init__(self, engine: Engine, *, idle_wait_s: float = 0.05):
        self.engine = engine
        self.model_name = engine.model_name
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle_wait_s = idle_wait_s
        self.after_step = None  # called on the loop's thread after every step (engine_process: its GPU profiler)
        self._ready = False
        self._error: BaseException | None = None

    @classmethod
    def from_pretrained(cls, model: str, *, device=None, dtype=None, options: EngineOptions = EngineOptions()):
        return cls(Engine.from_pretrained(model, device=device, dtype=dtype, options=options))

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="qasr-engine", daemon=True)
            self._thread.start()
        self._ready = True

    async def close(self) -> None:
        self._ready = False
        self.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    async def transcribe(self, request: DecodeRequest) -> DecodeResult:
        if self._stop.is_set() or self._error is not None:
            raise EngineClosed("the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def on_done(result):  # engine thread (or this one, for a request refused at once)
            loop.call_soon_threadsafe(settle, future, result)

        seq = self.engine.add(request, on_done)
        if self._stop.is_set() or self._error is not None:  # the loop ended meanwhile: nobody will finish `seq`
            seq.finish(EngineClosed("the engine is not running"))
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            seq.cancelled = True
            self._wake.set()
            raise

    def release_stream(self, stream_id: str) -> None:
        self.engine.release_stream(stream_id)
        self._wake.set()

    async def check_context(self, context: str, *, language: str | None = None, max_audio_seconds: float) -> None:
        self.engine.check_context(context, language=language, max_audio_seconds=max_audio_seconds)

    def stats(self) -> dict:
        return self.engine.stats()

    def submit(self, request: DecodeRequest, on_done) -> Sequence:
        """Queue a request from any thread and wake the loop; `on_done` as in `Engine.add` (EngineProcess uses it)."""
        seq = self.engine.add(request, on_done)
        self._wake.set()
        return seq

    def wake(self) -> None:
        """New work or a cancellation arrived (from another thread): step now instead of after the idle wait."""
        self._wake.set()

    def stop(self) -> None:
        """Ask `run()` to return; what is still queued or running then gets EngineClosed."""
        self._stop.set()
        self._wake.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """The engine loop, on the calling thread until `stop()` (start() runs it on a thread of its own)."""
        engine = self.engine
        try:
            while not self._stop.is_set():
                if engine.has_work():
                    engine.step()
                else:
                    engine.step()  # applies releases and drops cancelled work even when idle
                    t = time.perf_counter()
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    engine.seconds["idle"] += time.perf_counter() - t
                engine.thread_cpu_seconds = time.thread_time()
                if self.after_step is not None:
                    self.after_step()
        except BaseException as e:  # a broken engine fails every waiter instead of leaving them hanging
            log.exception("engine loop failed")
            self._error = e
            self._ready = False
            # as when an engine process dies: only what it held is lost (a stream gets an empty final with
            # decode_failed for that segment); what comes after gets EngineClosed (this engine is down for good)
            engine.fail_all(EngineCrashed(f"engine failed: {type(e).__name__}: {e}"))
            return
        engine.fail_all(EngineClosed("the engine was closed"))

