"""What word times cost per final (#17): the forced aligner alone, and inside the engine beside the ASR model.

    python -m qasr.bench.aligner_cost --size 0.6B --device cuda --out aligner_cost.json     # the H200 run
    python -m qasr.bench.aligner_cost --model DIR --aligner DIR --device cpu --batches 1,2   # tiny models

Random weights at the real shapes (--size 0.6B writes a 0.6B ASR checkpoint and a Qwen3-ForcedAligner-0.6B-shaped
aligner into a temporary folder; or give --model/--aligner), speech-like clips of --seconds, transcripts of
--words-per-second words. Two measurements, each the median of --repeats:
- "aligner": one `ForcedAligner.timestamp_classes` call (mel, encoder, decoder, head, one device-to-host copy) over
  B clips, for each B in --batches: ms per call and per final; B = 1 is a final aligned alone.
- "engine": B finals through the engine (decoding forced to --tokens tokens), with and without words: the aligner's
  share of the engine's time (its `seconds["align"]`) and the extra wall time, per final.
Prints one JSON object (and writes it to --out). Eager aligner forward: no CUDA graphs for it yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest
from qasr.model.aligner import ForcedAligner
from qasr.model.testmodel import make_test_aligner, make_test_model

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
    parser.add_argument("--skip-engine", action="store_true", help="only the aligner alone")
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


def aligner_alone(aligner: ForcedAligner, batches: list[int], args) -> list[dict]:
    rows = []
    for batch in batches:
        clips, texts = clips_and_texts(batch, args.seconds, args.words_per_second)
        inputs = [aligner.prepare(text, "English") for text in texts]
        ms = timed(lambda: aligner.timestamp_classes(clips, inputs), aligner.device, args.repeats)
        rows.append({"batch": batch, "ms_per_call": round(ms, 3), "ms_per_final": round(ms / batch, 3),
                     "words_per_final": len(inputs[0].words)})
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
    if any(b < 1 for b in batches) or args.repeats < 1 or args.seconds <= 0:
        print("aligner_cost: --batches, --repeats and --seconds must be positive", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        dtype = "bfloat16" if args.size != "tiny" else "float32"
        model = args.model or make_test_model(Path(scratch) / "asr", size=args.size, dtype=dtype)
        aligner_dir = args.aligner or make_test_aligner(Path(scratch) / "aligner", size=args.size, dtype=dtype)
        options = EngineOptions(num_slots=max(batches), num_retained=0, ignore_eos=True, aligner=str(aligner_dir),
                                aligner_max_batch=max(batches), max_len=1024)
        engine = Engine.from_pretrained(str(model), device=args.device, dtype=args.dtype, options=options)
        aligner = engine.aligner.aligner
        report = {
            "device": str(aligner.device), "dtype": str(aligner.network.classifier.weight.dtype).replace("torch.", ""),
            "size": args.size if args.model is None else str(args.model), "seconds": args.seconds,
            "words_per_second": args.words_per_second, "repeats": args.repeats, "cuda_graphs": False,
            "aligner": aligner_alone(aligner, batches, args),
        }
        if not args.skip_engine:
            report["engine"] = engine_with_and_without_words(engine, batches, args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
