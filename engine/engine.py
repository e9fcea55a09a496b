"""The engine: continuous batching of many streams' requests on one model.

`Engine.step()` is three calls, as in nano-vllm: admit (schedule + encode + prefill new sequences into free slots),
decode (one step for every running slot), postprocess (finish sequences, free slots). `AsyncEngine` runs that loop
on its own thread and hands results to asyncio futures; the event loop never waits on the GPU and the GPU never
waits on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qasr.model import audio as qaudio
from qasr.model.checkpoint import load_model, resolve_model_dir
from qasr.model.modeling import Qwen3ASR
from qasr.model.prompt import build_prompt, parse_output
from qasr.model.quantize import quantize_decoder_int8
from qasr.model.tokenizer import Tokenizer

from .request import DecodeRequest, DecodeResult, EngineClosed, Priority
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence
from .stream_cache import StreamCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    num_slots: int = 64  # sequences decoded together at most (the largest CUDA graph bucket)
    max_len: int = 1024  # prompt + generated tokens per sequence (a 30 s segment is ~410 prompt tokens)
    num_retained: int = 64  # extra KV slots keeping streams' reusable prefixes for their next partial
    max_prefill_tokens: int = 16384  # prompt tokens prefilled in one admission round
    admission_interval_ms: float = 20.0  # while sequences decode, they decode this long between two admissions: an
    # admission has a fixed cost (~8 ms at 0.6B on an H200) that, paid between every decode step under a steady
    # stream of partials, would leave decoding a fraction of the GPU; and under load one admission takes longer than
    # the interval, so counting it from the admission's start left finals one decode step per admission
    # (docs/benchmarks.md)
    max_audio_seconds: float = 60.0  # longest audio one request may carry
    base_tokens: int = 24  # default token budget: base_tokens + tokens_per_second x audio seconds
    tokens_per_second: float = 12.0  # (speech is ~3-5 tokens a second; the budget only stops a runaway decode)
    cuda_graphs: bool | None = None  # None: on a CUDA device
    fused_kernels: bool | None = None  # Triton kernels for the decoder (None: on CUDA when Triton is installed)
    repetition_window: int = 64  # stop a sequence whose last tokens are one short pattern repeated (0: off)
    ignore_eos: bool = False  # benchmarks only: decode exactly the token budget
    quantize: str | None = None  # "int8": weight-only int8 decoder projections (opt-in; see model/quantize.py)
    rollback_tokens: int = 5  # a partial continues its stream's previous partial minus this many last tokens (the
    # least settled ones, re-decoded); 0: partials decode from the audio alone

    def __post_init__(self):
        if (self.num_slots < 1 or self.max_len < 64 or self.num_retained < 0 or self.max_prefill_tokens < 1
                or self.admission_interval_ms < 0 or self.rollback_tokens < 0):
            raise ValueError(f"invalid engine options: {self}")
        if self.quantize not in (None, "int8"):
            raise ValueError(f"quantize must be None or 'int8', got {self.quantize!r}")


def check_context(tokenizer: Tokenizer, options: EngineOptions, context: str, *, language: str | None = None,
                  max_audio_seconds: float) -> None:
    """ValueError unless a request with this context and up to `max_audio_seconds` of audio fits a slot with its full
    default token budget (the server checks a stream's context once, at `start`)."""
    tokens = int(qaudio.num_audio_tokens(qaudio.num_frames(int(max_audio_seconds * qaudio.SAMPLE_RATE))))
    prompt = build_prompt(tokenizer, context=context, language=language, num_audio_tokens=tokens)
    budget = options.base_tokens + math.ceil(options.tokens_per_second * max_audio_seconds)
    if prompt.num_tokens + budget > options.max_len:
        bare = build_prompt(tokenizer, language=language, num_audio_tokens=tokens).num_tokens
        room = max(0, options.max_len - bare - budget)
        raise ValueError(
            f"context too long: {prompt.num_tokens - bare} tokens, but with segments up to "
            f"{max_audio_seconds:g} s this server has room for {room} (shorten the context or the maximum "
            f"segment, or start the server with a larger --max-len)")


def display_name(model: str) -> str:
    """What clients see: a local checkpoint's folder name (not its path on the server), or the hub id."""
    return Path(model).name if Path(model).is_dir() else str(model)


class Engine:
    """Synchronous core. `add()` is thread-safe; `step()` must be called from one thread only."""

    def __init__(self, model: Qwen3ASR, tokenizer: Tokenizer, options: EngineOptions = EngineOptions(), name: str = ""):
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.model_name = name
        self.eos_ids = () if options.ignore_eos else tokenizer.eos_ids
        self.device = model.device
        self.runner = ModelRunner(
            model,
            num_slots=options.num_slots,
            max_len=options.max_len,
            num_retained=options.num_retained,
            eos_ids=self.eos_ids,
            cuda_graphs=options.cuda_graphs,
            fused_kernels=options.fused_kernels,
        )
        self.scheduler = Scheduler()
        self.streams = StreamCache(range(options.num_slots, options.num_slots + options.num_retained))
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self._free_slots = list(range(options.num_slots))  # min-heap: low slots first keeps the bucket small
        self._lock = threading.Lock()  # guards the stream cache's release from other threads
        self._released: list[str] = []
        self.recent_batch_sizes: collections.deque[int] = collections.deque(maxlen=64)  # for metrics
        self.max_batch_size = 0
        self.steps = 0
        self._last_admission = -math.inf
        # cumulative work, to measure what partials reuse: prompt positions prefilled vs copied from a retained
        # prefix, encoder windows computed vs kept from a stream's earlier partial
        # decode_rows / steps is the mean decode batch
        self.counters = {"prefill_tokens": 0, "reused_tokens": 0, "encoded_windows": 0, "reused_windows": 0,
                         "decode_rows": 0}
        # where the engine thread's time goes (wall seconds): admissions (encode + prefill), decode steps (launch and
        # wait for the GPU), the host's per-row work after each step, and (AsyncEngine) waiting for work. Their
        # rates under load say whether the GPU, the engine's Python or something outside it (the event loop) bounds
        # a server.
        self.seconds = {"admit": 0.0, "decode_gpu": 0.0, "decode_host": 0.0, "idle": 0.0}
        self.thread_cpu_seconds = 0.0  # CPU the engine thread used (AsyncEngine): near its busy wall time means the
        # thread runs Python, not waits on the GPU

    @classmethod
    def from_pretrained(cls, model: str, *, device=None, dtype=None, options: EngineOptions = EngineOptions()):
        model_dir = resolve_model_dir(model)
        qwen = load_model(model_dir, device=device, dtype=dtype)
        if options.quantize == "int8":
            quantize_decoder_int8(qwen)
        return cls(qwen, Tokenizer.from_pretrained(model_dir), options, name=display_name(model))

    # -- submitting ------------------------------------------------------------------------------------------------

    def add(self, request: DecodeRequest, on_done) -> Sequence:
        """Queue a request; `on_done(result or exception)` is called once, on the engine thread (or here on error)."""
        seq = Sequence(request, on_done)
        try:
            self._validate(request)
        except ValueError as e:
            seq.finish(e)
            return seq
        self.scheduler.add(seq)
        return seq

    def _validate(self, req: DecodeRequest) -> None:
        audio = req.audio
        if not isinstance(audio, np.ndarray) or audio.ndim != 1:
            raise ValueError("request audio must be a 1-D float32 numpy array of 16 kHz samples")
        if audio.size < qaudio.HOP_LENGTH:
            raise ValueError(f"audio too short: {audio.size} samples (at least {qaudio.HOP_LENGTH}, 10 ms)")
        if audio.size > self.options.max_audio_seconds * qaudio.SAMPLE_RATE:
            raise ValueError(f"audio too long: {audio.size / qaudio.SAMPLE_RATE:.1f} s "
                             f"(the engine takes at most {self.options.max_audio_seconds:g} s per request)")
        if not np.isfinite(audio).all():
            raise ValueError("audio contains NaN or infinite samples")

    def check_context(self, context: str, *, language: str | None = None, max_audio_seconds: float) -> None:
        check_context(self.tokenizer, self.options, context, language=language, max_audio_seconds=max_audio_seconds)

    def release_stream(self, stream_id: str) -> None:
        """Forget a stream's cached windows and retained KV (thread-safe; applied before the next step)."""
        with self._lock:
            self._released.append(stream_id)

    # -- the loop --------------------------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.running) or len(self.scheduler) > 0

    @torch.inference_mode()
    def step(self) -> None:
        self._apply_releases()
        self._drop_cancelled()
        if self._free_slots and len(self.scheduler) and self._admission_due():
            start = time.perf_counter()
            self._admit()
            self._last_admission = time.perf_counter()  # the interval counts from the end: decoding gets it whole
            self.seconds["admit"] += self._last_admission - start
        if self.running:
            self._decode()

    def _admission_due(self) -> bool:
        """Admit at once when nothing decodes; otherwise batch arrivals into one admission per interval of decoding."""
        interval = self.options.admission_interval_ms / 1e3
        return not self.running or time.perf_counter() - self._last_admission >= interval

    def run_until_done(self) -> None:
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
            "running": len(self.running),
            "free_slots": len(self._free_slots),
            "streams_cached": len(self.streams),
            "steps": self.steps,
            "batch_sizes": list(self.recent_batch_sizes),
            "counters": dict(self.counters),
            "seconds": dict(self.seconds),
            "thread_cpu_seconds": self.thread_cpu_seconds,
        }

    # -- admit: prompt, encoder, prefill -----------------------------------------------------------------------------

    def _admit(self) -> None:
        t0 = time.perf_counter()
        seqs = self.scheduler.take(len(self._free_slots), self.options.max_prefill_tokens, self._prefill_cost)
        if not seqs:
            return
        try:
            seqs, embeds, starts = self._encode(seqs)
        except Exception as e:  # the encoder itself failed: nothing of this batch can run
            log.exception("encoding failed for %d sequences", len(seqs))
            for seq in seqs:
                seq.finish(e)
            return
        if not seqs:
            return
        t1 = time.perf_counter()
        slots = [heapq.heappop(self._free_slots) for _ in seqs]
        for seq, slot, start in zip(seqs, slots, starts):
            seq.slot = slot
            self.running[slot] = seq
            if start:  # copy the stream's retained prompt + audio KV instead of prefilling it again
                self.runner.copy_prefix(self.streams.peek(seq.stream_id).retained_slot, slot, start)
        first = self.runner.prefill([e[s:] for e, s in zip(embeds, starts)], slots, starts)
        self.counters["prefill_tokens"] += sum(e.shape[0] - s for e, s in zip(embeds, starts))
        self.counters["reused_tokens"] += sum(starts)
        self._retain_prefixes(seqs)
        t2 = time.perf_counter()
        live_slots, live_first, live_pos, live_budget = [], [], [], []
        for seq, tok in zip(seqs, first):
            seq.timings.update(queue_ms=(t0 - seq.t_submit) * 1e3, encode_ms=(t1 - t0) * 1e3,
                               prefill_ms=(t2 - t1) * 1e3)
            seq.t_decode = t2
            if self._accept(seq, tok):
                live_slots.append(seq.slot)
                live_first.append(tok)
                live_pos.append(seq.prompt.num_tokens)
                live_budget.append(seq.budget)
        if live_slots:
            self.runner.start_rows(live_slots, live_first, live_pos, live_budget)

    def _prefill_cost(self, seq: Sequence) -> int:
        frames = qaudio.num_frames(seq.request.audio.size)
        return int(qaudio.num_audio_tokens(frames)) + 32

    def _prepare_prompt(self, seq: Sequence, num_audio_tokens: int) -> None:
        """The sequence's prompt and token budget; ValueError if it cannot fit a slot.

        A partial's given prefix is the previous hypothesis: when a model runs on (a hallucination loop) it can
        outgrow what the audio could hold, so a prefix longer than the audio's token budget, or one that would not
        fit the slot, is dropped and the partial decodes from the audio alone.
        """
        req = seq.request
        seconds = req.audio.size / qaudio.SAMPLE_RATE
        default_budget = self.options.base_tokens + math.ceil(self.options.tokens_per_second * seconds)
        prompt = lambda answer_ids: build_prompt(self.tokenizer, context=req.context,  # noqa: E731
                                                 language=req.language, num_audio_tokens=num_audio_tokens,
                                                 answer_ids=answer_ids)
        answer_ids = self._rolled_back_answer(seq)
        seq.prompt = prompt(answer_ids)
        if answer_ids and (seq.prompt.num_tokens >= self.options.max_len or len(answer_ids) > default_budget):
            seq.prompt = prompt(())
        room = self.options.max_len - seq.prompt.num_tokens
        if room < 1:
            raise ValueError(f"the prompt ({seq.prompt.num_tokens} tokens for {req.audio.size / qaudio.SAMPLE_RATE:.1f}"
                             f" s of audio and the context) does not fit the engine's max_len {self.options.max_len}")
        seq.budget = max(1, min(room, req.max_new_tokens or default_budget))

    def _encode(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[torch.Tensor], list[int]]:
        """Mel + encoder for the admitted sequences (windows of all of them in one call) -> prompt embeddings.

        Returns the sequences that fit (the others are finished with their error), each one's full prompt
        embeddings [T, D], and how many leading positions can be copied from a retained KV prefix.
        """
        enc = self.model.encoder
        # every clip crosses to the device in one copy (one per clip cost ~0.3 ms of CPU each in a large admission)
        sizes = [s.request.audio.size for s in seqs]
        flat = torch.from_numpy(np.concatenate([s.request.audio for s in seqs]).astype(np.float32, copy=False))
        clips = list(torch.split(flat.to(self.device), sizes))
        feats, frames = qaudio.log_mel_batch(clips, device=self.device)
        fitting = []
        for seq, f, mel in zip(seqs, frames.tolist(), feats):
            try:
                self._prepare_prompt(seq, int(qaudio.num_audio_tokens(f)))
            except ValueError as e:  # this request only
                seq.finish(e)
                continue
            fitting.append((seq, f, mel))
        if not fitting:
            return [], [], []
        tails, tail_flags, reused = [], [], []
        for seq, f, mel in fitting:
            state = self._stream_state(seq)
            # windows wholly inside the audio (plus 2 frames of margin for the STFT's edge) never change
            keep = min(len(state.windows), self._whole_windows(f)) if state else 0
            reused.append(keep)
            tails.append(mel[:, keep * qaudio.WINDOW_FRAMES : f])
            tail_flags.append(keep > 0)
        windows, lengths, owners = enc.pack_windows(enc.embed_clips(tails, tail_flags))
        out = self.runner.encode_windows(windows, lengths)
        self.counters["encoded_windows"] += len(owners)
        self.counters["reused_windows"] += sum(reused)
        per_seq: list[list[torch.Tensor]] = [[] for _ in fitting]
        for w, (n, owner) in enumerate(zip(lengths.tolist(), owners)):
            per_seq[owner].append(out[w, :n])
        ids = np.concatenate([seq.prompt.input_ids for seq, _, _ in fitting])  # one copy and one lookup for all
        token_embeds = self.model.decoder.embed_tokens(torch.from_numpy(ids).to(self.device))
        token_embeds = token_embeds.split([seq.prompt.num_tokens for seq, _, _ in fitting])
        embeds, starts = [], []
        for (seq, f, _mel), keep, new, tokens in zip(fitting, reused, per_seq, token_embeds):
            state = self._stream_state(seq)
            if state is not None:
                kept = state.windows[:keep]
                fresh = [w for w in new[: self._whole_windows(f) - keep] if w.shape[0] == enc.cfg.window_tokens]
                state.windows = kept + fresh
                audio = torch.cat(kept + new)
            else:
                audio = torch.cat(new)
            embeds.append(self.model.splice_audio(tokens, audio, seq.prompt.audio_offset))
            starts.append(self._reusable_positions(seq, keep))
        return [seq for seq, _, _ in fitting], embeds, starts

    def _rolled_back_answer(self, seq: Sequence) -> tuple[int, ...]:
        """A partial's given prefix: its stream's previous partial's answer minus the last `rollback_tokens`."""
        state = self._stream_state(seq)
        if state is None or not self.options.rollback_tokens:
            return ()
        return state.answer_ids[: max(0, len(state.answer_ids) - self.options.rollback_tokens)]

    @staticmethod
    def _whole_windows(frames: int) -> int:
        return max(0, frames - 2) // qaudio.WINDOW_FRAMES

    def _stream_state(self, seq: Sequence):
        """Partials of a stream share cached state; finals never read it (they must equal offline decoding)."""
        if seq.request.priority is Priority.PARTIAL and seq.stream_id is not None:
            return self.streams.get(seq.stream_id)
        return None

    def _reusable_positions(self, seq: Sequence, windows: int) -> int:
        state = self._stream_state(seq)
        if state is None or state.retained_slot < 0 or state.prefix_ids != seq.prompt.prefix_ids:
            return 0
        n = min(windows, state.kv_windows)
        return len(seq.prompt.prefix_ids) + n * qaudio.WINDOW_TOKENS if n > 0 else 0

    def _retain_prefixes(self, seqs: list[Sequence]) -> None:
        """After prefill: keep each partial's prompt prefix + whole-window audio KV for the stream's next partial."""
        busy = {s.stream_id for s in self.running.values() if s.stream_id}
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

    def _decode(self) -> None:
        rows = max(self.running) + 1
        self.recent_batch_sizes.append(len(self.running))
        self.max_batch_size = max(self.max_batch_size, len(self.running))
        self.counters["decode_rows"] += len(self.running)
        t0 = time.perf_counter()
        out = self.runner.decode(rows).numpy()
        t1 = time.perf_counter()
        self.seconds["decode_gpu"] += t1 - t0
        self.steps += 1
        stopped = []
        for slot, seq in list(self.running.items()):
            tok, finished = int(out[0, slot]), bool(out[1, slot])
            if tok < 0:
                continue
            if not self._accept(seq, tok, finished):
                continue
            if self._repeating(seq.generated):
                stopped.append(slot)
                self._complete(seq, "repetition")
        self.runner.stop_rows(stopped)
        self.seconds["decode_host"] += time.perf_counter() - t1

    def _accept(self, seq: Sequence, tok: int, device_finished: bool | None = None) -> bool:
        """Record one generated token; returns whether the sequence keeps running."""
        if tok in self.eos_ids:
            self._complete(seq, "eos")
            return False
        seq.generated.append(tok)
        if device_finished or len(seq.generated) >= seq.budget:
            self._complete(seq, "length")
            return False
        return True

    def _repeating(self, tokens: list[int]) -> bool:
        """Token-level runaway guard: the last `repetition_window` tokens are one pattern of <= 8 tokens repeated."""
        w = self.options.repetition_window
        if not w or len(tokens) < w:
            return False
        tail = tokens[-w:]
        # compare from the newest token back: a sequence that is not looping fails at once (this runs per row per step)
        return any(all(tail[i] == tail[i - p] for i in range(w - 1, p - 1, -1)) for p in range(1, 9))

    def _complete(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.running.pop(seq.slot, None)
        heapq.heappush(self._free_slots, seq.slot)
        answer = (*seq.prompt.answer_ids, *seq.generated)
        if seq.request.priority is Priority.PARTIAL and seq.stream_id is not None:
            state = self.streams.peek(seq.stream_id)  # None once released: a late partial does not bring it back
            if state is not None:
                state.answer_ids = answer
        raw = self.tokenizer.decode(answer)
        language, text = parse_output(raw, seq.prompt.language)
        seq.timings["decode_ms"] = (time.perf_counter() - seq.t_decode) * 1e3
        seq.finish(DecodeResult(text=text, language=language, raw_text=raw, token_ids=tuple(seq.generated),
                                finish_reason=reason, num_audio_tokens=seq.prompt.num_audio_tokens,
                                timings=dict(seq.timings)))

    def _drop_cancelled(self) -> None:
        dropped = [slot for slot, seq in self.running.items() if seq.cancelled]
        for slot in dropped:
            seq = self.running.pop(slot)
            heapq.heappush(self._free_slots, slot)
            seq.finish(asyncio.CancelledError())
        self.runner.stop_rows(dropped)

    def _apply_releases(self) -> None:
        with self._lock:
            released, self._released = self._released, []
        for stream_id in released:
            self.streams.release(stream_id)

    def fail_all(self, error: BaseException) -> None:
        for seq in self.scheduler.drain() + list(self.running.values()):
            seq.finish(error)
        self.runner.stop_rows(list(self.running))
        self._free_slots = list(range(self.options.num_slots))
        self.running.clear()


class AsyncEngine:
    """The engine on its own thread, awaited from asyncio.

    `await transcribe(req)` returns the result; cancelling the awaiting task cancels the work (a queued request is
    dropped, a running one frees its slot at the next step). Raises `Superseded` when a newer partial of the same
    stream replaced a queued one, `EngineClosed` once the engine stops.
    """

    model_name: str

    def __init__(self, engine: Engine, *, idle_wait_s: float = 0.05):
        self.engine = engine
        self.model_name = engine.model_name
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle_wait_s = idle_wait_s
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
        except BaseException as e:  # a broken engine fails every waiter instead of leaving them hanging
            log.exception("engine loop failed")
            self._error = e
            self._ready = False
            engine.fail_all(EngineClosed(f"engine failed: {type(e).__name__}: {e}"))
            return
        engine.fail_all(EngineClosed("the engine was closed"))


def settle(future: asyncio.Future, result) -> None:
    """Complete `future` with a result or an exception (on its loop), unless it is done already."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
