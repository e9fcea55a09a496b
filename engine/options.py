"""The engine's options, one frozen object validated once (torch-free: the server's command line builds it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineOptions:
    num_slots: int = 64  # sequences decoded together at most (the largest CUDA graph bucket)
    max_len: int = 1024  # prompt + generated tokens per sequence (a 30 s segment is ~410 prompt tokens)
    num_retained: int = 64  # extra KV slots keeping streams' reusable prefixes for their next partial
    max_prefill_tokens: int = 16384  # prompt tokens prefilled in one admission round
    admission_interval_ms: float = 10.0  # while sequences decode, they decode this long between two admissions: an
    # admission has a fixed cost (~7 ms of host work at 0.6B on an H200) that, paid between every decode step under a
    # steady stream of partials, would leave decoding a fraction of the GPU; counted from the admission's end, so
    # decoding gets it whole. 10 ms, not 20: at 1,000 streams on one H200 lease (session 12, docs/benchmarks.md) 10
    # gave p95 finals of 257 / 271 / 239 ms against 20's 399 / 257 / 432 (30: 383 / 345 / 281): a longer interval
    # gathers larger admissions, and a final that arrives behind one waits for all of it
    decode_steps_ahead: int = 4  # decode steps queued at once beside an admission's host work, at most: as many as
    # fit in the time it has been taking (graphs feed themselves). One step alone leaves the decode stream idle once
    # it is done: at 1,000 streams on an H200 an admission's host work is ~7 ms against a 2-3 ms step (session 10).
    # 4 for live serving, where 1,000 streams held p95 <= 250 ms with it (launches averaging 1.3-1.7 steps); with 16
    # they averaged 3.1-4.6 and one check on a slow lease gave p95 353 / 255 / 353 ms, not comparable across leases
    # (session 14). Offline work takes OFFLINE_DECODE_STEPS_AHEAD. 1: one step, as before
    decode_run_ahead: bool = False  # queue the next decode step before reading the last one's output, so the GPU
    # does not wait while the host finishes rows, hands out results and launches again; a row the host stops
    # (repetition, cancel) then decodes one step more, unread. Offline work takes OFFLINE_DECODE_RUN_AHEAD: on an
    # H200 (session 20) the engine loop's step came to the graph's own (0.81 vs 0.80 ms at one row, 2.10 vs 2.05 at
    # 128; reading each step 0.88-0.91 and 2.26-2.46), a 40-token clip 38.9 / 39.0 ms against 43.0 / 46.7, throughput
    # +4-10%. Off for live serving: on one lease, three 1,000-stream runs each way, it made ~10% more steps a second
    # and a worse final p95 in every run (238-300 ms against 176-221, session 21). On the CPU a step runs whole at its
    # launch: running one ahead only delays each result by a step
    max_audio_seconds: float = 60.0  # longest audio one request may carry
    base_tokens: int = 24  # default token budget: base_tokens + tokens_per_second x audio seconds
    tokens_per_second: float = 12.0  # (speech is ~3-5 tokens a second; the budget only stops a runaway decode)
    cuda_graphs: bool | None = None  # None: on a CUDA device
    fused_kernels: bool | None = None  # Triton kernels for the decoder (None: on CUDA when Triton is installed)
    repetition_window: int = 64  # stop a sequence whose last tokens are one short pattern repeated (0: off)
    ignore_eos: bool = False  # benchmarks only: decode exactly the token budget
    rollback_tokens: int = 5  # a partial continues its stream's previous partial minus this many last tokens (the
    # least settled ones, re-decoded); 0: partials decode from the audio alone
    aligner: str | None = None  # a Qwen3-ForcedAligner checkpoint (directory or Hugging Face id), loaded beside the
    # model on its device: finals that ask get word times (qasr.engine.aligner_runner); None: no word times
    aligner_max_batch: int = 8  # finals aligned in one aligner forward at most; one forward is in flight at a time,
    # so this bounds the aligner's share of the GPU beside the decode steps. 8, not 32: on the H200 (session 5, no
    # priorities) a 128-row decode step took 4.8 ms beside an 8-final alignment (20 ms) and 10.0 ms beside a 32-final
    # one (66 ms), so 8 costs decoding the fewest steps per final aligned (~0.4, vs ~0.5 at 1 and at 32) and caps the
    # step at half the stall; 8 finals per 20 ms forward is ~400 finals a second, above the ~60 of 600 streams with
    # words on (2,467 finals in a 40 s run)
    aligner_min_batch: int = 8  # while sequences decode, an aligner forward waits for this many parked finals (capped
    aligner_max_wait_ms: float = 150.0  # at aligner_max_batch) or until the oldest has waited this long; with nothing
    # decoding it launches at once. Fewer, fuller forwards: a forward costs about the same for 1 final as for 8 (34.9
    # vs 36.0 ms on the H200, docs/benchmarks.md), its kernels hold SMs the decode steps and admissions then wait for
    # (running blocks are not preempted, whatever the stream's priority), and each launch costs the engine thread its
    # host part. At 600 streams, half with words (~60 finals a second with words), launching whenever the last
    # forward was done made 5.3 finals a forward (234 forwards in 20 s, one every 85 ms); 8 finals gather in ~130 ms
    # at that rate, so 150 ms gives full forwards under load and bounds the wait at low load.
    # aligner_min_batch 1 (or aligner_max_wait_ms 0): launch as soon as the previous forward is done
    kv_int8: bool = False  # the KV cache as int8 with a scale a vector (model/kv_int8.py): about half the bytes a
    # decode step's attention reads, which at large batches is most of the step, and half the cache's memory. Tokens
    # are not bit for bit the bf16 cache's (a vector is off by up to half its absmax / 127 per value):
    # docs/benchmarks.md has the speed and the agreement measured
    fp8_prefill: bool = False  # every prefill's qkv, gate_up and down products in FP8, their inputs quantized by the
    # kernels before them (model/fp8.py); decode steps unchanged. Needs the fused kernels and FP8 tensor cores (Ada,
    # Hopper). Tokens are not bit for bit bf16's: docs/benchmarks.md has the speed and the agreement measured
    fp8_encoder: bool = False  # the audio encoder's q/k/v, fc1 and fc2 products in FP8 the same way, their inputs
    # quantized by its LayerNorms and GELU (fp8.attach_encoder); the same needs and caveat as fp8_prefill
    fp8_lm_head: bool = False  # the lm_head's weight rounded to FP8 (model/fp8_lm_head.py): a small decode step's
    # lm_head streams half its bytes (batch-1 latency), the larger ones multiply the same rounded numbers in bf16.
    # Needs the fused kernels. Tokens are not bit for bit bf16's: docs/benchmarks.md has what was measured (session 38)
    stream_priorities: bool = True  # decode steps and admissions on a high-priority CUDA stream, the aligner's forward
    # on the lowest (qasr.engine.streams), so that finals without words keep their pace; False: decoding on the
    # thread's default stream, as before (benchmarks compare)

    def __post_init__(self):
        for name, least in MINIMUMS.items():
            if getattr(self, name) < least:
                raise ValueError(f"invalid engine options: {name} must be >= {least}, got {getattr(self, name):g}")


# the opt-in number formats (EngineOptions fields, all off by default) and what each command line's flag says of them
NUMBER_FORMATS = {
    "kv_int8": "keep the KV cache as int8 with a scale per vector: half the memory a slot needs and about half the "
               "bytes a decode step's attention reads",
    "fp8_prefill": "run every prefill's qkv, gate_up and down products in FP8 (GPUs with FP8 tensor cores: Ada, "
                   "Hopper); decode steps stay bf16",
    "fp8_encoder": "run the audio encoder's q/k/v, fc1 and fc2 products in FP8 the same way",
    "fp8_lm_head": "round the lm_head's weight to FP8: small decode steps stream half its bytes (a request's "
                   "latency)",
}


def add_number_format_flags(parser, note: str, default: bool | None = False) -> None:
    """The NUMBER_FORMATS flags (--kv-int8, ...) on an argparse parser (store_true; `default` None: unset unless
    given), each help ending with `note`."""
    for field, text in NUMBER_FORMATS.items():
        parser.add_argument("--" + field.replace("_", "-"), action="store_true", default=default,
                            help=f"{text}; {note}")


def number_formats(source) -> dict[str, bool]:
    """The NUMBER_FORMATS fields of parsed arguments or EngineOptions, as keyword arguments."""
    return {field: getattr(source, field) for field in NUMBER_FORMATS}


# decode_steps_ahead for offline work (file transcription, qasr-bench offline): admissions of ~200 clips take longer
# than 4 steps, and on one H200 16 gave 7,990 / 7,927 / 7,916 audio-s/s against 4's 7,669 / 6,796 / 7,515
# (bench.offline_sweep, alternating, session 14)
OFFLINE_DECODE_STEPS_AHEAD = 16
OFFLINE_DECODE_RUN_AHEAD = True  # decode_run_ahead for offline work (see there)

# the least value of each numeric option (qasr-server checks its flags against these before it loads a model)
MINIMUMS = {"num_slots": 1, "max_len": 64, "num_retained": 0, "max_prefill_tokens": 1, "admission_interval_ms": 0,
            "rollback_tokens": 0, "decode_steps_ahead": 1, "aligner_max_batch": 1, "aligner_min_batch": 1,
            "aligner_max_wait_ms": 0}


def display_name(model: str) -> str:
    """What clients see: a local checkpoint's folder name (not its path on the server), or the hub id."""
    return Path(model).name if Path(model).is_dir() else str(model)
