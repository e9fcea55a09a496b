"""What word times cost per final (#17): the forced aligner alone (eager and from CUDA graphs), its host part, what
an alignment in flight costs the decode steps beside it, and the engine end to end.

    python -m qasr.bench.aligner_cost --size 0.6B --device cuda --out aligner_cost.json     # the H200 run
    python -m qasr.bench.aligner_cost --model DIR --aligner DIR --device cpu --batches 1,2   # tiny models

Random weights at the real shapes (--size 0.6B writes a 0.6B ASR checkpoint and a Qwen3-ForcedAligner-0.6B-shaped
aligner into a temporary folder; or give --model/--aligner), speech-like clips of --seconds, transcripts of
--words-per-second words. Each figure is the median of --repeats:
- "aligner": B clips aligned in one call, for each B in --batches (B = 1 is a final aligned alone): `eager_ms` (the
  eager forward at the batch's own shape) beside `graphed_ms` (padded to its bucket and replayed from the engine's
  CUDA graphs; on a CPU the same padded buffers run eagerly and `cuda_graphs` is false); ms per call and per final.
  Both include the mel, the upload and the one device-to-host read.
- "host": the engine thread's part of a launch: `prepare_ms` (split and tokenize the words), `plan_ms` (the batch's
  layout, padded to its bucket), `park_ms` (`AlignerRunner.park()` of the B finals, which prepares their words), and
  `launch_ms`, the whole `AlignerRunner.launch()` (layout, pinned staging, copies, mel and graph launches queued on
  the aligner's stream; on a CPU it also runs the forward); `syncs_per_launch`: the calls in launch() that made the
  host wait for the device (CUDA's sync debug mode; 0 expected, None on a CPU).
- "overlap": --decode-rows rows decode (CUDA-graph steps) while one alignment batch of B finals is in flight on the
  side stream: the decode step's ms alone and during the alignment, the steps that ran meanwhile, and the
  alignment's wall ms from launch to done while decoding vs alone. With --priority both (the default) every batch is
  measured twice in the one run: decoding on the thread's default stream (`decode_priority` 0, the aligner's equal,
  as before) and on qasr.engine.streams' high-priority decode stream (`decode_priority` -3 on CUDA, what the engine
  does with EngineOptions.stream_priorities); the aligner's stream has priority 0 in both.
- "engine": B finals through the engine (decoding forced to --tokens tokens), with and without words: the aligner
  stage's share of the engine thread (its `seconds["align"]`) and the extra wall time, per final.
Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from qasr.engine.aligner_graphs import AlignerGraphs
from qasr.engine.aligner_runner import AlignerRunner
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest, DecodeResult
from qasr.engine.sequence import Sequence
from qasr.engine.streams import decode_stream
from qasr.model.aligner import ForcedAligner
from qasr.model.testmodel import make_test_aligner, make_test_model

from .report import print_report
from .synthetic import speech_like

SR = 16000
VOCABULARY = ("the", "call", "was", "about", "a", "refund", "for", "order", "number", "seven", "please", "check",
              "account", "today", "thank", "you")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m qasr.bench.aligner_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="0.6B", choices=["tiny", "0.6B"],
                        help="random checkpoints written for the run when --model/--aligner are not given")
    parser.add_argument("--model", default=None, help="ASR checkpoint directory (default: a random one of --size)")
    parser.add_argument("--aligner", default=None, help="aligner checkpoint directory (default: a random one)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,8,32,64", help="finals aligned together, comma-separated")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each final's segment")
    parser.add_argument("--words-per-second", type=float, default=2.5, help="transcript length per second of audio")
    parser.add_argument("--tokens", type=int, default=20, help="tokens each final decodes in the engine measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-rows", type=int, default=128, help="rows decoding beside an alignment (overlap)")
    parser.add_argument("--priority", choices=("off", "on", "both"), default="both",
                        help="overlap: decode steps at the aligner's priority (off), on a high-priority stream (on), "
                             "or each batch both ways (default: %(default)s)")
    parser.add_argument("--skip-engine", action="store_true", help="only the aligner alone, its host part and overlap")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    return parser


def clips_and_texts(count: int, seconds: float, words_per_second: float) -> tuple[list[np.ndarray], list[str]]:
    rng = np.random.default_rng(0)
    clips = [speech_like(seconds, seed=i) for i in range(count)]
    num_words = max(1, round(seconds * words_per_second))
    texts = [" ".join(rng.choice(VOCABULARY, num_words)) for _ in range(count)]
    return clips, texts


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median wall ms of fn() over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def aligner_alone(aligner: ForcedAligner, graphs: AlignerGraphs, batches: list[int], args) -> list[dict]:
    rows = []
    for batch in batches:
        clips, texts = clips_and_texts(batch, args.seconds, args.words_per_second)
        inputs = [aligner.prepare(text, "English") for text in texts]
        eager = timed(lambda: aligner.timestamp_classes(clips, inputs), aligner.device, args.repeats)
        row = {"batch": batch, "words_per_final": len(inputs[0].words), "eager_ms_per_call": round(eager, 3),
               "eager_ms_per_final": round(eager / batch, 3)}
        plan = aligner.plan(clips, inputs)
        shape = graphs.shape_for(plan)
        row["bucket"] = shape
        if shape is not None:
            padded = plan.padded(*shape, pad_id=aligner.tokenizer.endoftext_id)

            def replay():
                with torch.inference_mode():
                    return padded.read_classes(graphs.run(padded, aligner.upload_clips(clips)).cpu().numpy())

            graphed = timed(replay, aligner.device, args.repeats)
            row.update(graphed_ms_per_call=round(graphed, 3), graphed_ms_per_final=round(graphed / batch, 3),
                       same_classes=replay() == aligner.timestamp_classes(clips, inputs))
        rows.append(row)
    return rows


def park(runner: AlignerRunner, clips: list[np.ndarray], texts: list[str]) -> None:
    """Decoded finals as the engine parks them, for a launch."""
    for clip, text in zip(clips, texts):
        seq = Sequence(DecodeRequest(audio=clip, language="English", words=True), lambda result: None)
        runner.park(seq, DecodeResult(text=text, language="English", raw_text=text, token_ids=(),
                                      finish_reason="length", num_audio_tokens=0))


@contextlib.contextmanager
def counting_syncs(device: torch.device):
    """Counts the calls that made the host wait for the device inside the block (CUDA's sync debug mode: a value
    read back, a blocking or pageable copy) -> a one-item list filled on exit; empty off CUDA."""
    counted: list[int] = []
    if device.type != "cuda":
        yield counted
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counted
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counted.append(sum("synchroniz" in str(w.message) for w in caught))


def host_part(runner: AlignerRunner, batches: list[int], args) -> list[dict]:
    aligner, rows = runner.aligner, []
    for batch in batches:
        clips, texts = clips_and_texts(batch, args.seconds, args.words_per_second)
        prepare, plan, parking, launch, syncs = [], [], [], [], []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            inputs = [aligner.prepare(text, "English") for text in texts]
            t1 = time.perf_counter()
            layout = aligner.plan(clips, inputs)
            if runner.graphs is not None and (shape := runner.graphs.shape_for(layout)) is not None:
                layout.padded(*shape, pad_id=aligner.tokenizer.endoftext_id)
            t2 = time.perf_counter()
            park_seconds = runner.park_seconds
            park(runner, clips, texts)
            parking.append(runner.park_seconds - park_seconds)
            sync(aligner.device)
            t3 = time.perf_counter()
            with counting_syncs(aligner.device) as counted:
                runner.launch()
            t4 = time.perf_counter()
            runner.poll(wait_s=float("inf"))
            prepare.append(t1 - t0)
            plan.append(t2 - t1)
            launch.append(t4 - t3)
            syncs.append(counted[0] if counted else None)
        ms = lambda xs: round(statistics.median(xs[1:]) * 1e3, 3)  # noqa: E731  (the first run warms up)
        rows.append({"batch": batch, "prepare_ms": ms(prepare), "plan_ms": ms(plan), "park_ms": ms(parking),
                     "launch_ms": ms(launch), "syncs_per_launch": syncs[-1]})
    return rows


def overlap(engine: Engine, batches: list[int], args) -> list[dict]:
    """Decode steps with an alignment batch in flight on the aligner's stream vs without, for each --priority mode:
    decoding on the thread's current stream (priority 0, the aligner's), then on a high-priority one."""
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.priority]
    rows = []
    for prioritized in modes:
        stream = decode_stream(engine.runner.device) if prioritized else None
        with torch.cuda.stream(stream):  # a no-op for None (and on a CPU)
            rows += overlap_at(engine, batches, args, prioritized, stream.priority if stream is not None else 0)
        if stream is not None:
            torch.cuda.current_stream(engine.runner.device).wait_stream(stream)
    return rows


def overlap_at(engine: Engine, batches: list[int], args, prioritized: bool, decode_priority: int) -> list[dict]:
    runner, device, decode_rows = engine.aligner, engine.runner.device, args.decode_rows
    slots = list(range(decode_rows))

    def restart_rows():  # garbage KV, real shapes: positions from a 30 s prompt's length on, no budget to stop them
        engine.runner.start_rows(slots, [0] * decode_rows, [400] * decode_rows, [10**6] * decode_rows)

    def step_ms() -> float:
        t = time.perf_counter()
        engine.runner.decode(decode_rows)
        return (time.perf_counter() - t) * 1e3

    rows = []
    for batch in batches:
        clips, texts = clips_and_texts(batch, args.seconds, args.words_per_second)
        park(runner, clips, texts)
        runner.run()  # warm-up
        alone, beside, flight_ms, steps = [], [], [], []
        for _ in range(args.repeats):
            sync(device)
            park(runner, clips, texts)
            t = time.perf_counter()
            runner.run()
            alone.append((time.perf_counter() - t) * 1e3)
            restart_rows()
            plain = [step_ms() for _ in range(20)]
            park(runner, clips, texts)
            sync(device)
            t = time.perf_counter()
            runner.launch()
            during = []
            while runner.num_in_flight and len(during) < 500:
                during.append(step_ms())
                runner.poll()
            runner.poll(wait_s=float("inf"))
            flight_ms.append((time.perf_counter() - t) * 1e3)
            beside.append((statistics.median(plain), statistics.median(during) if during else None,
                           max(during) if during else None))
            steps.append(len(during))
            engine.runner.stop_rows(slots)
        median = lambda xs: round(statistics.median(xs), 3) if None not in xs else None  # noqa: E731
        rows.append({"batch": batch, "decode_rows": decode_rows, "prioritized": prioritized,
                     "decode_priority": decode_priority,
                     "aligner_priority": runner.stream.priority if runner.stream is not None else 0,
                     "step_ms_alone": median([b[0] for b in beside]),
                     "step_ms_during_alignment": median([b[1] for b in beside]),
                     "step_ms_during_alignment_max": median([b[2] for b in beside]),
                     "steps_during_alignment": statistics.median(steps),
                     "alignment_ms_alone": median(alone), "alignment_ms_beside_decoding": median(flight_ms)})
    sync(device)
    return rows


def engine_with_and_without_words(engine: Engine, batches: list[int], args) -> list[dict]:
    rows = []
    for batch in batches:
        clips, _ = clips_and_texts(batch, args.seconds, args.words_per_second)
        result = {"batch": batch}
        for words in (False, True):
            requests = [DecodeRequest(audio=clip, language="English", max_new_tokens=args.tokens, words=words)
                        for clip in clips]
            align_s = []

            def run():
                before = engine.seconds["align"]
                engine.transcribe(requests)
                align_s.append(engine.seconds["align"] - before)

            ms = timed(run, engine.runner.device, args.repeats)
            key = "with_words" if words else "without_words"
            result[f"{key}_ms"] = round(ms, 3)
            if words:
                result["align_ms_per_final"] = round(statistics.median(align_s[1:]) * 1e3 / batch, 3)
        result["extra_ms_per_final"] = round((result["with_words_ms"] - result["without_words_ms"]) / batch, 3)
        rows.append(result)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 for b in batches) or args.repeats < 1 or args.seconds <= 0 or args.decode_rows < 1:
        print("aligner_cost: --batches, --repeats, --seconds and --decode-rows must be positive", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        dtype = "bfloat16" if args.size != "tiny" else "float32"
        model = args.model or make_test_model(Path(scratch) / "asr", size=args.size, dtype=dtype)
        aligner_dir = args.aligner or make_test_aligner(Path(scratch) / "aligner", size=args.size, dtype=dtype)
        options = EngineOptions(num_slots=max(*batches, args.decode_rows), num_retained=0, ignore_eos=True,
                                aligner=str(aligner_dir), aligner_max_batch=max(batches), max_len=1024)
        engine = Engine.from_pretrained(str(model), device=args.device, dtype=args.dtype, options=options)
        runner = engine.aligner
        aligner = runner.aligner
        # on a CPU nothing is captured: the same padded buffers run eagerly
        graphs = runner.graphs or AlignerGraphs(aligner, max_rows=runner.max_batch, capture=False)
        report = {
            "device": str(aligner.device), "dtype": str(aligner.network.classifier.weight.dtype).replace("torch.", ""),
            "size": args.size if args.model is None else str(args.model), "seconds": args.seconds,
            "words_per_second": args.words_per_second, "repeats": args.repeats,
            "cuda_graphs": graphs.num_graphs > 0, "graphs": graphs.num_graphs, "priority": args.priority,
            "capture_seconds": round(graphs.capture_seconds, 2),
            "buckets": {"rows": graphs.row_buckets, "tokens": graphs.token_buckets, "windows": graphs.window_buckets},
            "aligner": aligner_alone(aligner, graphs, batches, args),
            "host": host_part(runner, batches, args),
            "overlap": overlap(engine, batches, args),
        }
        if not args.skip_engine:
            report["engine"] = engine_with_and_without_words(engine, batches, args)
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
