"""The model runner: turns admitted sequences into tokens on one device. Nothing else in the engine calls the model.

It owns the KV cache, the per-slot decode state that lives on the device, and one CUDA graph per batch-size bucket.
The decode step feeds its own argmax back and checks EOS and token budgets on the device; the host reads one small
[2, B] tensor per step (tokens, finished flags), never one scalar per row. On the CPU the same step runs eagerly.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from qasr.model import audio as qaudio
from qasr.model import conv_kernels, fp8, kernels
from qasr.model.fp8_lm_head import attach as round_lm_head
from qasr.model.modeling import (FusedLayerOps, PlainLayerOps, Qwen3ASR, host_to_device, prefill_keys, ranges,
                                 window_lengths)
from qasr.model.prompt import Prompt

from . import host_copy

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# encoder windows per graphed run; more windows replay the largest graph several times. Finer than powers of two:
# the windows of a call are split by length bucket first, and each group is padded to a window bucket
ENCODER_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# positions an encoder window runs at: one of n real positions runs at the smallest >= n (the last is the whole
# window), so a partial's window in progress (a few 13-position chunks, mostly 13 k + 1 positions) is not run at 104.
# Its positions past n are never read by its real ones: their keys are masked, and positions are added per chunk
# before the encoder (the encoder is block-diagonal per window, per-position elsewhere)
ENCODER_LENGTH_BUCKETS = (32, 56, 104)  # multiples of 8 (aligned attention masks); 13 k + 1 -> 32 or 56
# a call of at most this many windows runs them all in one run, at the longest length bucket any of them needs: at so
# few positions a run of the encoder's 18 (24) layers costs its launches' fixed time whatever its length, so one run
# per length bucket only adds a chain of them (a 10.9 s clip's windows of 104 and 39 positions: two runs of ~0.9 ms
# of GPU time each at batch 1, H200 profile, session 37)
ENCODER_MERGED_WINDOWS = 4
# chunks (100 mel frames) per graphed run of the encoder's conv front end; more replay the largest graph several times.
# Eagerly every new chunk count is a new shape to cuDNN, whose plan search held the engine thread 18% of its samples
# in a (perturbed) native py-spy run at 1,000 streams (session 10: get_configs_from_heuristics under conv2d)
CONV_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
FUSED_CONV1_ENV = "QASR_FUSED_CONV1"  # "0": the conv front end's first convolution on PyTorch (see __init__)
# prefills graphed per (sequences, padded tokens): eagerly, ~250 launches from Python cost more than the GPU work (a
# 10.9 s clip: 8.4 ms eager, measured on the H200); more sequences replay several graphs. A graph holds at most
# PREFILL_GRAPH_TOKENS sequences x padded tokens (past one sequence): 8 x 1,024, the largest graph at the default
# max_len before 16 and 32 came in (at --max-len 640 the largest was 5,120 tokens; past 1,024, 8 sequences are no
# longer graphed at the longest lengths). So 16 and 32 sequences are graphed at the shorter lengths, where a prefill
# of 8 (~1,300 tokens) left its norms, RoPE, SiLU and attention kernels too small to fill the GPU (session 14)
PREFILL_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
PREFILL_GRAPH_TOKENS = 8192
PREFILL_BATCHES_ENV = "QASR_PREFILL_BATCHES"  # e.g. "1,2,4,8": the largest prefill graphs at fewer sequences (A/B)
# the prefill's padded lengths: (up to, step) rungs, fine where prompts are (a partial's: ~25-110 tokens), coarser
# beyond; the last step goes on to max_len
PREFILL_LENGTH_STEPS = ((128, 16), (256, 32), (None, 64))


def prefill_length_buckets(max_len: int, steps=PREFILL_LENGTH_STEPS) -> tuple[int, ...]:
    """The prefill's graphed lengths, up to the first that holds max_len tokens."""
    ladder, length = [], 0
    for top, step in steps:
        while length < max_len and (top is None or length + step <= top):
            length += step
            ladder.append(length)
    if ladder[-1] < max_len:
        raise ValueError(f"PREFILL_LENGTH_STEPS end before max_len {max_len}")
    return tuple(ladder)


def bucket_of(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n (buckets ascending)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} is past the largest bucket, {buckets[-1]}")


def bucketed_pieces(items, buckets: tuple[int, ...]) -> list[tuple[object, int]]:
    """`items` (a list or range) in pieces of at most the largest bucket, each with the smallest bucket it fits:
    how a call larger than its largest graph replays graphs."""
    top = buckets[-1]
    return [(items[c : c + top], bucket_of(len(items[c : c + top]), buckets)) for c in range(0, len(items), top)]


def prefill_graphed(batch: int, length: int, max_tokens: int = PREFILL_GRAPH_TOKENS) -> bool:
    """Is (sequences, padded tokens) a prefill graph's shape? One sequence always; more within max_tokens."""
    return batch == 1 or batch * length <= max_tokens


def prefill_replays(lengths: list[int], batch_buckets: tuple[int, ...], length_buckets: tuple[int, ...],
                    max_tokens: int = PREFILL_GRAPH_TOKENS) -> list[tuple[list[int], int, int]]:
    """How a prefill of sequences of these lengths is padded: sorted by length (similar lengths together, less
    padding), each group the most sequences a graph of its length holds (prefill_graphed) -> per group (its
    sequences' indices, the sequences and the length it runs at)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    replays, c = [], 0
    while c < len(order):
        for most in reversed(batch_buckets):  # the largest group whose padded shape is graphed (one always is)
            chunk = order[c : c + most]
            batch, length = bucket_of(len(chunk), batch_buckets), bucket_of(lengths[chunk[-1]], length_buckets)
            if prefill_graphed(batch, length, max_tokens):
                break
        replays.append((chunk, batch, length))
        c += len(chunk)
    return replays


def prefill_batch_buckets() -> tuple[int, ...]:
    """PREFILL_BATCH_BUCKETS, or $QASR_PREFILL_BATCHES's ("1,2,4,8": benchmarks compare)."""
    value = os.environ.get(PREFILL_BATCHES_ENV)
    if not value:
        return PREFILL_BATCH_BUCKETS
    try:
        buckets = tuple(sorted({int(b) for b in value.split(",")}))
    except ValueError:
        raise ValueError(f"{PREFILL_BATCHES_ENV} must be sequence counts like 1,2,4,8, got {value!r}") from None
    if buckets[0] != 1:  # a single sequence must always have its graph (and no count may be 0 or less)
        raise ValueError(f"{PREFILL_BATCHES_ENV} must be positive sequence counts including 1, got {value!r}")
    return buckets


def encoder_replays(sizes: list[int], length_buckets: tuple[int, ...], window_buckets: tuple[int, ...] | None,
                    merged_windows: int = 0) -> list[tuple[int, list[int], int]]:
    """How an encoder call over windows of these real positions runs: grouped by length bucket, each group in
    pieces of at most the largest window bucket -> per run (its length, its windows' indices, the windows it runs:
    a window bucket, or without window_buckets (eagerly) the windows themselves). A call of at most
    `merged_windows` windows is one group, at the longest length bucket any of them needs."""
    if 0 < len(sizes) <= merged_windows:
        length_buckets = (bucket_of(max(sizes), length_buckets),)
    runs = []
    for length in length_buckets:
        group = [w for w, n in enumerate(sizes) if bucket_of(n, length_buckets) == length]
        pieces = bucketed_pieces(group, window_buckets) if window_buckets else [(group, len(group))] if group else []
        runs += [(length, piece, windows) for piece, windows in pieces]
    return runs


@contextlib.contextmanager
def capture_stream():
    """A side stream to capture graphs on (as torch.cuda.graph requires), joined back and synchronized after."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def capture_graph(fn, stream: torch.cuda.Stream, pool, warmups: int) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `fn` `warmups` times outside the graph (Triton compiles its kernels then), then record it into `pool`
    (None: a new pool, then `graph.pool()` for the graphs after it) -> (graph, what the recorded call returned)."""
    for _ in range(warmups):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    return graph, out


def advance_rows(next_tokens: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor,
                 budgets: torch.Tensor, eos: torch.Tensor, out: torch.Tensor) -> None:
    """After a decode step's argmax, in place, for rows b < B = len(next_tokens): a live row (positions[b] >= 0)
    counts its token and finishes on an EOS id or its budget; out[0, b] = its token or -1, out[1, b] = finished;
    tokens[b] takes the token; positions[b] moves on by one, or goes idle (-1) once finished.
    kernels.advance_rows does the same in one launch."""
    B = next_tokens.shape[0]
    pos = positions[:B]
    live = pos >= 0
    n = counts[:B] + live.long()
    finished = live & ((next_tokens[:, None] == eos[None, :]).any(-1) | (n >= budgets[:B]))
    out[0, :B] = torch.where(live, next_tokens, -1)
    out[1, :B] = finished.long()
    tokens[:B] = torch.where(live, next_tokens, tokens[:B])
    positions[:B] = torch.where(live & ~finished, pos + 1, -1)
    counts[:B] = n


@dataclass
class FirstTokens:
    """What a prefill made: the first generated token of each sequence, still on the device (reading it would make the
    host wait for the prefill). tokens[j] is that of the prefill's sequence order[j]."""

    tokens: torch.Tensor
    order: list[int]
    computed: int = 0  # token positions the device ran, padding included (buckets pad sequences and lengths)

    def tolist(self) -> list[int]:
        """Read to the host (waits for the prefill), in the prefill's sequence order."""
        first = [0] * len(self.order)
        for i, token in zip(self.order, self.tokens.tolist()):
            first[i] = token
        return first


class PrefillBucket:
    """Static inputs of one (sequences, tokens) prefill shape and, on CUDA, its captured graph.

    meta rows: slots, starts, lengths; rows past the real sequences have length 0 (every token padded: they write
    only the cache's scratch position of slot 0).
    """

    def __init__(self, runner: "ModelRunner", batch: int, tokens: int):
        model = runner.model
        self.runner = runner
        self.x = torch.zeros(batch, tokens, model.cfg.text.hidden_size, dtype=model.dtype, device=runner.device)
        self.meta = torch.zeros(3, batch, dtype=torch.long, device=runner.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.first: torch.Tensor | None = None

    def forward(self) -> torch.Tensor:
        return self.runner._prefill_first(self.x, self.meta[0], self.meta[1], self.meta[2], None)

    def run(self, embeds: list[torch.Tensor], meta: list[list[int]]) -> torch.Tensor:
        """embeds: per sequence [T_i, D], written straight into the static input (its stale tail is padding:
        tokens past a sequence's length are never read by its real tokens)."""
        B, T = len(embeds), self.x.shape[1]
        # one indexed copy for all sequences (a copy each was a launch a sequence)
        rows = ranges(np.arange(B) * T, [e.shape[0] for e in embeds])
        self.x.view(-1, self.x.shape[-1]).index_copy_(0, self.runner.to_device(torch.from_numpy(rows)),
                                                      torch.cat(embeds))
        pad = self.meta.shape[1] - B
        # pinned and non-blocking: the host goes on to the next bucket instead of waiting for the GPU to get here
        on_cuda = self.meta.device.type == "cuda"
        self.meta.copy_(torch.tensor([row + [0] * pad for row in meta], pin_memory=on_cuda), non_blocking=on_cuda)
        if self.graph is None:
            return self.forward()[:B]
        self.graph.replay()
        return self.first[:B]


MAX_LAUNCHES_IN_FLIGHT = 2  # the engine's run-ahead: the step it reads, and the next one queued before the read


class _HostOutputs:
    """Pinned host memory that one launch's outputs are copied to, and (on CUDA) the event after the copies."""

    def __init__(self, slots: int, device: torch.device):
        self.pinned = device.type == "cuda"
        self.out = torch.zeros(1, 2, slots, dtype=torch.long, pin_memory=self.pinned)  # [steps, 2, rows]
        self.tokens = torch.zeros(slots, dtype=torch.long, pin_memory=self.pinned)  # the tokens a first step is fed
        # around the launch's steps on the device: their time, whenever the GPU got to them (elapsed_time)
        self.started = torch.cuda.Event(enable_timing=True) if self.pinned else None
        self.copied = torch.cuda.Event(enable_timing=True) if self.pinned else None

    def make_room(self, steps: int) -> None:
        if steps > self.out.shape[0]:
            self.out = torch.zeros(steps, *self.out.shape[1:], dtype=torch.long, pin_memory=self.pinned)


@dataclass
class _Launched:
    rows: int
    read_tokens: bool
    steps: int
    host: _HostOutputs


class ModelRunner:
    def __init__(
        self,
        model: Qwen3ASR,
        *,
        num_slots: int,
        max_len: int,
        num_retained: int = 0,
        eos_ids: tuple[int, ...] = (151645, 151643),
        cuda_graphs: bool | None = None,
        fused_kernels: bool | None = None,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        kv_int8: bool = False,
        fp8_prefill: bool = False,
        fp8_encoder: bool = False,
        fp8_lm_head: bool = False,
    ):
        self.model = model
        self.device = model.device
        self.num_slots = num_slots  # decode rows; slots [num_slots, num_slots + num_retained) hold retained prefixes
        self.max_len = max_len
        self.cache = model.new_cache(num_slots + num_retained, max_len, int8=kv_int8)
        self.eos = torch.tensor(eos_ids or (-1,), device=self.device)  # -1: no token is EOS
        # per-slot decode state (device): the token to feed, its position (-1 = idle), tokens made, token budget
        S = num_slots
        self.tokens = torch.zeros(S, dtype=torch.long, device=self.device)
        self.positions = torch.full((S,), -1, dtype=torch.long, device=self.device)
        self.counts = torch.zeros(S, dtype=torch.long, device=self.device)
        self.budgets = torch.zeros(S, dtype=torch.long, device=self.device)
        self.out = torch.zeros(2, S, dtype=torch.long, device=self.device)  # [token or -1, finished] per row
        # where each launch's outputs land on the host, one set per launch that can be in flight (launch_decode)
        self._host_outputs = [_HostOutputs(S, self.device) for _ in range(MAX_LAUNCHES_IN_FLIGHT)]
        self._in_flight: collections.deque[_Launched] = collections.deque()  # launched, not read, oldest first
        self.launches = 0  # decode launches made: the number the next one gets
        self.last_step_s: float | None = None  # a step's device time in the launch read last (CUDA only)
        self.encoder_positions_run = 0  # encoder positions computed: windows padded to a length bucket, and their
        # number to a graph bucket
        self.conv_chunks_run = 0  # chunks the conv front end computed (their number padded to a graph bucket)
        self.host_reads = 0  # times the host waited for the device to hand it a result (decode steps, the mel's
        # extremes, first tokens read apart): what overlapping host and device work is about, counted
        self.buckets = tuple(b for b in buckets if b < S) + (S,)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # (window length, windows) -> (graph, output)
        self.encoder_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.conv_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # chunks -> (graph, output)
        # fused Triton kernels for the decoder: on CUDA when Triton is installed, unless asked otherwise
        self.fused_kernels = kernels.available(self.device) if fused_kernels is None else fused_kernels
        if self.fused_kernels and not kernels.available(self.device):
            raise ValueError(f"fused kernels need Triton and a CUDA device (got {self.device})")
        # the conv front end: its first convolution, bias and GELU in one kernel with the fused kernels, the
        # convolutions after it then channels-last (H200: a 64-chunk graph 1.61 -> 0.89 ms, offline throughput +6.5%);
        # $QASR_FUSED_CONV1=0: PyTorch's, for comparison
        fused_conv1 = self.fused_kernels and os.environ.get(FUSED_CONV1_ENV, "1") != "0"
        self.embed_conv_chunks = functools.partial(model.encoder.embed_chunks,
                                                   first_conv=conv_kernels.conv1_gelu if fused_conv1 else None)
        if fused_conv1:  # the layout the channels-last input gets from cuDNN anyway, once instead of every call
            for conv in (model.encoder.conv2d2, model.encoder.conv2d3):
                conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
        # the decoder's layer ops, chosen once: every decode step (and so every graph) runs on them, and every prefill
        # on prefill_ops, the same but for FP8 products where asked (model/fp8.py: its quantizing norms are kernels)
        for asked, products in ((fp8_prefill, "FP8 prefill products"), (fp8_encoder, "FP8 encoder products"),
                                (fp8_lm_head, "FP8 lm_head weights")):
            if asked and not self.fused_kernels:
                raise ValueError(f"{products} need the fused kernels (Triton and a CUDA device)")
        self.fp8_products = fp8.attach(model) if fp8_prefill else 0
        self.fp8_encoder_products = fp8.attach_encoder(model) if fp8_encoder else 0
        self.fp8_encoder = fp8_encoder  # every encoder run takes them
        if fp8_lm_head:
            round_lm_head(model)
        rope = model.decoder.rope_table(self.cache.length) if self.fused_kernels else None
        self.layer_ops = FusedLayerOps(rope, fp8_lm_head=fp8_lm_head) if self.fused_kernels else PlainLayerOps()
        self.prefill_ops = (FusedLayerOps(rope, fp8_products=True, fp8_lm_head=fp8_lm_head) if fp8_prefill
                            else self.layer_ops)
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.prefill_buckets: dict[tuple[int, int], PrefillBucket] = {}
        self.prefill_lengths = prefill_length_buckets(max_len)  # the graphed prefill's padded lengths
        batches = prefill_batch_buckets()  # and its sequence counts (an admission has num_slots at most)
        self.prefill_batches = tuple(b for b in batches if b < num_slots) + tuple(b for b in batches
                                                                                  if b >= num_slots)[:1]
        # the encoder's window lengths (ENCODER_LENGTH_BUCKETS, cut at and ending with this model's window)
        window = model.encoder.cfg.window_tokens
        self.encoder_lengths = tuple(n for n in ENCODER_LENGTH_BUCKETS if n < window) + (window,)
        if use_graphs:
            self.capture_graphs()
            self.capture_encoder_graphs()
            self.capture_conv_graphs()
            if self.fused_kernels:  # the fused prefill's shapes depend only on (sequences, tokens)
                self.build_prefill_buckets(capture=True)

    # -- decode ----------------------------------------------------------------------------------------------------

    def _step(self, B: int) -> None:
        """One decode step for rows [0, B): pure tensor ops on persistent buffers, so it can be graphed."""
        # nxt: the argmax [B], or where the lm_head is a GEMV kernel its block maxima (kernels.BlockMaxima), whose
        # argmax kernels.advance_rows takes: no PyTorch op between the step's first kernel and its last
        _, nxt = self.model.decoder.decode_greedy(self.tokens[:B], self.positions[:B], self.cache, self.layer_ops)
        # the bookkeeping after the argmax: one fused launch instead of ~18 small ones where the kernels run
        advance = kernels.advance_rows if self.fused_kernels else advance_rows
        advance(nxt, self.tokens, self.positions, self.counts, self.budgets, self.eos, self.out)

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture one graph per bucket, largest first, all in one memory pool. Needs every slot idle."""
        pool = None
        with capture_stream() as stream:
            for B in reversed(self.buckets):
                self.graphs[B], _ = capture_graph(lambda: self._step(B), stream, pool, warmups=2)
                pool = self.graphs[B].pool() if pool is None else pool
        log.info("captured decode graphs for buckets %s", list(self.graphs))

    @torch.inference_mode()
    def decode(self, rows: int) -> torch.Tensor:
        """Run one step over the first `rows` slots (padded up to a bucket) -> host [2, rows] (token|-1, finished).
        Nothing else may be in flight (benches and tests: the engine launches and reads on its own)."""
        if self._in_flight:
            raise RuntimeError("decode() with a launch in flight: read it first")
        self.launch_decode(rows)
        return self.read_decode()[0][0]

    @property
    def launches_in_flight(self) -> int:
        return len(self._in_flight)

    @torch.inference_mode()
    def launch_decode(self, rows: int, read_tokens: bool = False, steps: int = 1) -> int:
        """Queue `steps` steps over the first `rows` slots, each feeding on the one before on the device, with the
        copy of each one's [2, slots] output to the host, and return at once on CUDA (a graph's replay is asynchronous):
        the host works on while they run; `read_decode` waits for them. read_tokens: also copy the tokens the first
        step is fed, as they are before it (first tokens of rows started since the last step), in the same read.
        Up to MAX_LAUNCHES_IN_FLIGHT launches may wait for their reads, which come in launch order (the engine's
        run-ahead queues the next step before it reads the last, so the GPU does not wait for the host's work).
        -> this launch's number (`launches` before it)."""
        if len(self._in_flight) >= MAX_LAUNCHES_IN_FLIGHT:
            raise RuntimeError(f"{MAX_LAUNCHES_IN_FLIGHT} decode launches are in flight, none read")
        host = self._host_outputs[self.launches % MAX_LAUNCHES_IN_FLIGHT]  # free: its last launch was read
        host.make_room(steps)
        B = self.bucket_for(rows)
        if read_tokens:
            host.tokens[:B].copy_(self.tokens[:B], non_blocking=True)
        if host.started is not None:
            host.started.record()
        for i in range(steps):
            if B in self.graphs:
                self.graphs[B].replay()
            else:
                self._step(B)
            # every slot, not [:, :B]: PyTorch may copy a strided slice to the host through a pageable temporary,
            # which makes the host wait for the step; a contiguous copy into pinned memory is a plain async memcpy
            host.out[i].copy_(self.out, non_blocking=True)
        if host.copied is not None:
            host.copied.record()
        self._in_flight.append(_Launched(rows, read_tokens, steps, host))
        self.launches += 1
        return self.launches - 1

    def read_decode(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Wait for the oldest launch's steps -> host [steps, 2, rows] (token|-1, finished per step, in order) and,
        if asked at its launch, the tokens its first step was fed [rows] (else None). One wait for all its steps, and
        not for a launch queued after it."""
        if not self._in_flight:
            raise RuntimeError("no decode step launched")
        launched = self._in_flight.popleft()
        host = launched.host
        if host.copied is not None:
            host.copied.synchronize()
            self.last_step_s = host.started.elapsed_time(host.copied) / 1e3 / launched.steps
        self.host_reads += 1
        fed = host.tokens[: launched.rows] if launched.read_tokens else None
        return host.out[: launched.steps, :, : launched.rows], fed

    def forget_launches(self) -> None:
        """Drop the launches not read (the engine failed: nothing will read them)."""
        self._in_flight.clear()

    def to_device(self, values, dtype=torch.long) -> torch.Tensor:
        """A small host list (or CPU tensor) on the device without waiting (host_to_device)."""
        return host_to_device(values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype),
                              self.device)

    def start_rows(self, slots: list[int], first_tokens: list[int] | torch.Tensor, positions: list[int],
                   budgets: list[int]) -> None:
        """Put freshly prefilled sequences into decode: they continue from their first generated token.

        first_tokens: a list, or the prefill's tensor still on the device (the host need not read it first). A row
        whose first token already ends it (an EOS id, or a budget of 1) is left idle: the host, reading the first
        tokens with the next step, finishes it as it always did."""
        idx = self.to_device(slots)
        first = first_tokens if isinstance(first_tokens, torch.Tensor) else self.to_device(first_tokens)
        budget = self.to_device(budgets)
        done = (first[:, None] == self.eos[None, :]).any(-1) | (budget <= 1)
        self.tokens[idx] = first
        self.positions[idx] = torch.where(done, -1, self.to_device(positions))
        self.counts.index_fill_(0, idx, 1)  # not `counts[idx] = 1`: a Python scalar put through a CUDA index is first
        # copied to the device from pageable memory, and that copy waits for everything queued (py-spy at 1000
        # streams: 21% of the engine thread, waiting for each admission's encoder and prefill before the next step)
        self.budgets[idx] = budget

    def stop_rows(self, slots: list[int]) -> None:
        """Idle these rows (cancelled, or stopped by the host's repetition guard)."""
        if slots:
            self.positions.index_fill_(0, self.to_device(slots), -1)  # not `[...] = -1`: see start_rows

    # -- prefill ---------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, embeds: list[torch.Tensor], slots: list[int], starts: list[int]) -> FirstTokens:
        """Write the new tokens of each sequence into its slot after `starts[i]` reused positions.

        embeds: per sequence [T_i, D] (the prompt positions from starts[i] on) -> first generated token each, left
        on the device: the engine hands them to start_rows and reads them with the next decode step's output, so
        the host does not wait for the prefill (py-spy at 1000 streams: that wait was 18% of the engine thread).
        """
        lengths = [e.shape[0] for e in embeds]
        if not self.prefill_buckets:
            return FirstTokens(self._prefill_eager(embeds, slots, starts, lengths), list(range(len(embeds))),
                               len(embeds) * max(lengths))
        # a graph holds as many sequences as its length allows (prefill_replays): a larger admission replays
        # several, similar lengths together (less padding). Eagerly, its ~250 Triton launches cost more CPU than the
        # GPU work.
        # The chunks' first tokens stay on the device: a read per chunk made the host wait for each chunk's GPU work
        # before it could queue the next (measured at 1000 streams).
        order: list[int] = []
        tokens: list[torch.Tensor] = []
        computed = 0
        for chunk, batch, length in prefill_replays(lengths, self.prefill_batches, self.prefill_lengths):
            order += chunk
            args = [[embeds[i] for i in chunk], [slots[i] for i in chunk], [starts[i] for i in chunk],
                    [lengths[i] for i in chunk]]
            bucket = self.prefill_buckets.get((batch, length))  # None: no graphs (the CPU) or no buckets built
            if bucket:  # a copy: the bucket's static output is overwritten when the bucket replays again
                tokens.append(bucket.run(args[0], args[1:]).clone())
                computed += bucket.x.shape[0] * bucket.x.shape[1]
            else:
                tokens.append(self._prefill_eager(*args))
                computed += len(chunk) * max(args[3])
        return FirstTokens(torch.cat(tokens), order, computed)

    def _prefill_eager(self, embeds, slots, starts, lengths) -> torch.Tensor:
        T = max(lengths)
        x = torch.stack([torch.nn.functional.pad(e, (0, 0, 0, T - e.shape[0])) for e in embeds])
        dev = self.to_device
        num_keys = prefill_keys(max(s + n for s, n in zip(starts, lengths)), self.cache)
        return self._prefill_first(x, dev(slots), dev(starts), dev(lengths), num_keys)

    def _prefill_first(self, x, slots, starts, lengths, num_keys) -> torch.Tensor:
        """Prefill, then the greedy first token of each sequence [B] (a row of length 0 reads its position 0)."""
        hidden = self.model.decoder.prefill(x, slots, starts, lengths, self.cache, self.prefill_ops, num_keys)
        last = hidden[torch.arange(x.shape[0], device=x.device), (lengths - 1).clamp(min=0)]
        return self.model.decoder.lm_head(last).argmax(dim=-1)

    @torch.inference_mode()
    def build_prefill_buckets(self, capture: bool) -> None:
        """Static buffers per (sequences, padded tokens) bucket, each with its CUDA graph when `capture`
        (largest first, one memory pool). Needs the fused kernels; every slot idle. Without `capture` the buckets
        only pad (the CPU tests check that padding changes nothing)."""
        if not self.fused_kernels:
            raise ValueError("prefill buckets need the fused kernels (the plain prefill's shapes depend on its data)")
        keys = [(b, t) for b in self.prefill_batches for t in self.prefill_lengths if prefill_graphed(b, t)]
        keys.sort(key=lambda k: k[0] * k[1], reverse=True)
        buckets = {key: PrefillBucket(self, *key) for key in keys}
        if capture:
            pool = None
            with capture_stream() as stream:
                for bucket in buckets.values():  # warm-up with lengths 0: writes only scratch
                    bucket.graph, bucket.first = capture_graph(bucket.forward, stream, pool, warmups=1)
                    pool = bucket.graph.pool() if pool is None else pool
            log.info("captured %d prefill graphs", len(keys))
        self.prefill_buckets = buckets

    # -- audio and prompt embeddings ---------------------------------------------------------------------------

    @property
    def window_tokens(self) -> int:
        """Encoder tokens of one whole attention window."""
        return self.model.encoder.cfg.window_tokens

    @torch.inference_mode()
    def log_spectrogram(self, clips: list[np.ndarray], first_frames: list[int],
                        staged: torch.Tensor | None = None) -> torch.Tensor:
        """Raw log10 mel frames (before the clip-wide floor) of 16 kHz clips, each from first_frames[i] to its end
        -> [B, mels, n_max] on the device, zero past clip i's num_frames(len) - first_frames[i] frames.

        Only the samples those frames read cross to the device, all clips in one copy (one per clip cost ~0.3 ms of
        CPU each in a large admission). staged: stage_samples' samples for these clips, if taken before."""
        staged = self.stage_samples(clips, first_frames)[0] if staged is None else staged
        flat = staged.to(self.device, non_blocking=self.device.type == "cuda")
        sizes = [clip.size - qaudio.stft_start_sample(first) for clip, first in zip(clips, first_frames)]
        log_spec, _ = qaudio.log_spectrogram_batch(list(torch.split(flat, sizes)),
                                                   [clip.size for clip in clips], first_frames, device=self.device)
        return log_spec

    def stage_samples(self, clips: list[np.ndarray], first_frames: list[int]) -> tuple[torch.Tensor, list[bool]]:
        """The host half of log_spectrogram (it can run while the device decodes): the samples its frames read, all
        clips' in one host tensor, pinned on CUDA (so that their copy waits for nothing) -> (that tensor, whether each
        clip's samples are all finite: those copied as they are, the rest of the clip, which kept chunks stand for,
        apart)."""
        starts = [qaudio.stft_start_sample(first) for first in first_frames]
        tails = [clip[start:] for clip, start in zip(clips, starts)]
        # concatenated straight into (pinned) memory of the tensor's own: one copy of the samples, not two
        flat = torch.empty(sum(tail.size for tail in tails), dtype=torch.float32, pin_memory=self.device.type == "cuda")
        finite = host_copy.copy_samples(tails, flat.numpy())
        return flat, [ok and host_copy.all_finite(clip[:start]) for ok, clip, start in zip(finite, clips, starts)]

    @torch.inference_mode()
    def chunk_extremes(self, log_spec: torch.Tensor, counts: list[int]) -> np.ndarray:
        """The least and greatest value of each 100-frame chunk of `log_spec` [B, mels, n_max] (chunk-aligned frames;
        clip i has counts[i]) -> host [2, B, chunks]: (min, max), +inf/-inf past a clip's frames. One read for all."""
        B, _, n = log_spec.shape
        chunks = -(-n // qaudio.CHUNK_FRAMES)
        if chunks == 0:  # no clip has new frames
            return np.zeros((2, B, 0), dtype=np.float32)
        padded = torch.nn.functional.pad(log_spec, (0, chunks * qaudio.CHUNK_FRAMES - n))
        beyond = self._past_counts(padded.shape[-1], counts)
        lows = padded.masked_fill(beyond, float("inf")).view(B, qaudio.N_MELS, chunks, -1).amin(dim=(1, 3))
        highs = padded.masked_fill(beyond, float("-inf")).view(B, qaudio.N_MELS, chunks, -1).amax(dim=(1, 3))
        self.host_reads += 1  # needed: the host decides from them whether kept chunks changed
        return torch.stack([lows, highs]).cpu().numpy()

    @torch.inference_mode()
    def clip_maxima(self, log_spec: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each clip's greatest value over its counts[i] frames of `log_spec` [B, mels, n], left on the device as
        [B, 1, 1] (-inf for a clip without frames): the maximum chunk_extremes' highs give the host, bit for bit."""
        B, _, n = log_spec.shape
        if n == 0:
            return log_spec.new_full((B, 1, 1), float("-inf"))
        return log_spec.masked_fill(self._past_counts(n, counts), float("-inf")).amax(dim=(1, 2)).view(B, 1, 1)

    def _past_counts(self, frames: int, counts: list[int]) -> torch.Tensor:
        """[B, 1, frames] on the device: True at clip i's frames from counts[i] on (not its own)."""
        return (torch.arange(frames, device=self.device)[None, :] >= self.to_device(counts)[:, None])[:, None, :]

    @torch.inference_mode()
    def floor_log_spectrogram(self, log_spec: torch.Tensor, clip_maxes: list[float] | torch.Tensor) -> torch.Tensor:
        """The features: each clip's raw frames [B, mels, n] floored 8 below its whole clip's maximum, then scaled.
        clip_maxes: the host's floats, or clip_maxima's device tensor."""
        clip_max = (clip_maxes if isinstance(clip_maxes, torch.Tensor)
                    else self.to_device(clip_maxes, dtype=log_spec.dtype).view(-1, 1, 1))
        return qaudio.floor_log_spectrogram(log_spec, clip_max)

    @torch.inference_mode()
    def embed_chunks(self, mels: list[torch.Tensor], continued: list[bool]) -> list[torch.Tensor]:
        """The encoder's conv front end over mels [mels, F_i] in 100-frame chunks -> tokens [num_tokens(F_i), D] each.
        continued[i]: mel i continues earlier chunks (a stream's kept ones), so its last chunk is padded like a long
        clip's."""
        return self.model.encoder.embed_clips(mels, continued, self._embed_chunks)

    def _embed_chunks(self, chunks: torch.Tensor) -> torch.Tensor:
        """The conv front end over chunks [N, mels, chunk_frames] -> [N, tokens_per_chunk, D]: on CUDA in pieces of at
        most the largest graph bucket, each replaying its bucket's graph (one piece: the graph's output itself, valid
        until its next replay; more: copied into one tensor as they come)."""
        if not self.conv_graphs:
            self.conv_chunks_run += chunks.shape[0]
            return self.embed_conv_chunks(chunks)
        pieces, out = bucketed_pieces(range(chunks.shape[0]), CONV_BUCKETS), None
        for piece, bucket in pieces:
            # rows past the piece keep an earlier call's chunks: convolutions are per chunk, their outputs unread
            self._conv_chunks[: len(piece)].copy_(chunks[piece.start : piece.stop])
            graph, y = self.conv_graphs[bucket]
            graph.replay()
            self.conv_chunks_run += bucket
            if len(pieces) == 1:
                return y[: len(piece)]
            out = y.new_empty(chunks.shape[0], *y.shape[1:]) if out is None else out
            out[piece.start : piece.stop] = y[: len(piece)]
        return out

    @torch.inference_mode()
    def encode(self, clips: list[torch.Tensor]) -> list[torch.Tensor]:
        """The encoder's transformer over several clips' conv tokens [T_i, D] (each starting at a window boundary),
        their windows packed into one call -> per clip, its windows' outputs one after the other [T_i, out]: a view
        of the packed output, where every window of a clip but its last is whole (a slice a window was 2.6% of the
        engine thread offline, py-spy on an H100, session 22)."""
        windows, lengths, _ = self.model.encoder.pack_windows(clips)
        # each window's length from the clips' shapes (reading pack_windows' device copy would wait for the encoder)
        size = self.window_tokens
        sizes = [window_lengths(clip.shape[0], size) for clip in clips]
        out = self.encode_windows(windows, lengths, [n for clip in sizes for n in clip])
        flat = out.reshape(-1, out.shape[-1])  # window w's positions from w * size on
        per_clip, w = [], 0
        for clip in sizes:
            per_clip.append(flat[w * size : (w + len(clip) - 1) * size + clip[-1]])
            w += len(clip)
        return per_clip

    @torch.inference_mode()
    def embed_prompts(self, prompts: list[Prompt], audio: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Each prompt's token embeddings with its audio (audio[i]: pieces [n, D] that together fill its audio
        placeholders, in order) -> [T_i, D] each, views of one tensor. One lookup, one cat and one indexed copy for
        all prompts: a cat of each clip's windows and a splice per prompt were two launches a clip (py-spy of an
        offline run on the H200, session 21: 2.7% of the engine thread in the splice alone)."""
        sizes = [sum(piece.shape[0] for piece in pieces) for pieces in audio]
        for prompt, size in zip(prompts, sizes):
            if size != prompt.num_audio_tokens:
                raise ValueError(f"a prompt of {prompt.num_audio_tokens} audio positions got {size} audio tokens")
        lengths = np.array([prompt.num_tokens for prompt in prompts])
        rows = ranges(np.cumsum(lengths) - lengths + [prompt.audio_offset for prompt in prompts], sizes)
        # the text positions' ids; the audio positions look up id 0, the audio written over them below (building each
        # prompt's input_ids, audio placeholders and all, was 3.7% of the engine thread offline)
        ids = np.zeros(lengths.sum(), dtype=np.int64)
        text = np.ones(ids.size, dtype=bool)
        text[rows] = False
        ids[text] = list(itertools.chain.from_iterable(prompt.prefix_ids + prompt.suffix_ids for prompt in prompts))
        embeds = self.model.decoder.embed_tokens(self.to_device(torch.from_numpy(ids)))
        if rows.size:
            embeds.index_copy_(0, self.to_device(torch.from_numpy(rows)),
                               torch.cat([piece for pieces in audio for piece in pieces]).to(embeds.dtype))
        return list(embeds.split([prompt.num_tokens for prompt in prompts]))

    @torch.inference_mode()
    def encode_windows(self, windows: torch.Tensor, lengths: torch.Tensor, sizes: list[int] | None = None
                       ) -> torch.Tensor:
        """The encoder's transformer over packed windows [W, window_tokens, D] of lengths [W] real positions
        -> [W, window_tokens, out]: window w's output is its first sizes[w] positions (past them: its padding's up to
        the length it ran at, zeros after).

        sizes: the host's copy of `lengths` (reading the device's would wait for it). With it, each window runs at its
        length bucket (self.encoder_lengths), the windows of a bucket together (a call of at most
        ENCODER_MERGED_WINDOWS windows: all together, at the longest bucket any needs); without it, every window runs
        whole.
        A window's output does not depend on its padding: its real positions never read the others.
        On CUDA each run replays a captured graph per (length, windows) bucket: eagerly, the encoder's ~200 small
        launches per call cost more CPU time than its GPU work at a few windows.
        """
        W, T = windows.shape[:2]
        graphs = ENCODER_BUCKETS if self.encoder_graphs else None
        runs = encoder_replays([T] * W if sizes is None else sizes,
                               self.encoder_lengths if sizes is not None else (T,), graphs, ENCODER_MERGED_WINDOWS)
        if graphs is None and len(runs) == 1 and runs[0][0] == T:  # every window whole, in order: as it is
            self.encoder_positions_run += W * T
            return self.model.encoder.encode_windows(windows, lengths, self.fp8_encoder)
        out = windows.new_zeros(W, T, self.model.encoder.cfg.output_dim)
        order = self.to_device([w for _, piece, _ in runs for w in piece])  # the windows, run after run
        first = 0
        for length, piece, bucket in runs:
            rows, first = order[first : first + len(piece)], first + len(piece)
            self.encoder_positions_run += bucket * length
            if graphs is None:
                y = self.model.encoder.encode_windows(windows[:, :length].index_select(0, rows),
                                                      lengths.index_select(0, rows), self.fp8_encoder)
            else:
                y = self._replay_encoder(windows, lengths, rows, length, bucket)
            # into the answer: a copy, as callers keep windows (a stream's cache) and the graph's output is
            # overwritten by its next replay
            out[:, :length].index_copy_(0, rows, y)
        return out

    def _replay_encoder(self, windows, lengths, rows, length: int, bucket: int) -> torch.Tensor:
        """Windows `rows` of `windows` through the graph of (length, bucket) -> its output [len(rows), length, out]."""
        n = rows.shape[0]
        static, static_lengths = self._enc_windows[length], self._enc_lengths[length]
        torch.index_select(windows[:, :length], 0, rows, out=static[:n])
        static[n:bucket].zero_()
        torch.index_select(lengths, 0, rows, out=static_lengths[:n])
        static_lengths[n:bucket] = 1  # padding windows attend to one (zero) position: no empty softmax
        graph, out = self.encoder_graphs[(length, bucket)]
        graph.replay()
        return out[:n]

    @torch.inference_mode()
    def capture_encoder_graphs(self) -> None:
        """One encoder graph per (window length, windows) bucket, largest first, in a memory pool of their own."""
        cfg = self.model.encoder.cfg
        top = ENCODER_BUCKETS[-1]
        self._enc_windows = {n: torch.zeros(top, n, cfg.d_model, dtype=self.model.dtype, device=self.device)
                             for n in self.encoder_lengths}
        self._enc_lengths = {n: torch.ones(top, dtype=torch.long, device=self.device) for n in self.encoder_lengths}
        encode = functools.partial(self.model.encoder.encode_windows, fp8_products=self.fp8_encoder)
        keys = sorted(((n, W) for n in self.encoder_lengths for W in ENCODER_BUCKETS), key=lambda k: k[0] * k[1],
                      reverse=True)
        pool = None
        with capture_stream() as stream:
            for n, W in keys:
                graph, out = capture_graph(lambda: encode(self._enc_windows[n][:W], self._enc_lengths[n][:W]), stream,
                                           pool, warmups=2)
                pool = graph.pool() if pool is None else pool
                self.encoder_graphs[(n, W)] = (graph, out)
        log.info("captured %d encoder graphs (window lengths %s)", len(keys), list(self.encoder_lengths))

    @torch.inference_mode()
    def capture_conv_graphs(self) -> None:
        """One conv front-end graph per chunk-count bucket, largest first, in a memory pool of their own."""
        cfg = self.model.encoder.cfg
        self._conv_chunks = torch.zeros(CONV_BUCKETS[-1], cfg.num_mel_bins, cfg.chunk_frames, dtype=self.model.dtype,
                                        device=self.device)
        embed, pool = self.embed_conv_chunks, None
        with capture_stream() as stream:
            for n in reversed(CONV_BUCKETS):
                graph, out = capture_graph(lambda: embed(self._conv_chunks[:n]), stream, pool, warmups=2)
                pool = graph.pool() if pool is None else pool
                self.conv_graphs[n] = (graph, out)
        log.info("captured %d conv front-end graphs", len(CONV_BUCKETS))

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot `src` into slot `dst` (all layers)."""
        if length > 0:
            for t in self.cache.tensors:
                t[dst, :, :length] = t[src, :, :length]
