"""FP8 products in the admissions (qasr.model.fp8) against bfloat16, both engines in one process on one lease (#16).

    python -m qasr.bench.fp8_admission --model DIR --num-clips 4096 --slots 512 --runs 3

Two engines on the same checkpoint, one with its prefill and encoder products of at least `--min-rows` rows in FP8,
the other as it is; their throughput runs alternate (bf16, fp8, bf16, ...) so the lease's drift falls on both. Also:
batch-1 latency of each (the one clip's products are below the threshold: both should match), the tokens of the
FP8 engine against the bf16 one's on the same clips (decoding forced: a row that differs once differs after), and
identical clips in one FP8 batch giving identical rows. Prints one JSON line per timed run, then a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from qasr.engine.engine import Engine
from qasr.engine.gc_pauses import freeze_loaded_heap, thaw
from qasr.model import fp8
from qasr.model.checkpoint import load_model
from qasr.model.tokenizer import Tokenizer

from .offline import _sync, offline_options, requests, throughput_run
from .synthetic import speech_like


def build(model_dir: str, device: str, dtype: str, options, min_rows: int | None) -> Engine:
    model = load_model(model_dir, device=device, dtype=dtype)
    if min_rows is not None:
        fp8.quantize(model, min_rows)
    return Engine(model, Tokenizer.from_pretrained(model_dir), options)


def latency_ms(engine: Engine, clip, tokens: int, runs: int) -> float:
    for _ in range(3):
        engine.transcribe(requests([clip], tokens))
    times = []
    for _ in range(runs):
        _sync(engine.runner.device)
        t = time.perf_counter()
        engine.transcribe(requests([clip], tokens))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def agreement(reference: list, other: list) -> dict:
    """Tokens of `other` against `reference`, request by request (same clips, same order)."""
    same_tokens = sum(sum(a == b for a, b in zip(r.token_ids, o.token_ids)) for r, o in zip(reference, other))
    total = sum(len(r.token_ids) for r in reference)
    first = [next((i for i, (a, b) in enumerate(zip(r.token_ids, o.token_ids)) if a != b), None)
             for r, o in zip(reference, other)]
    differing = [i for i in first if i is not None]
    return {"exact_match": f"{sum(i is None for i in first)}/{len(first)}", "token_agreement": same_tokens / max(1, total),
            "first_difference_median": statistics.median(differing) if differing else None}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m qasr.bench.fp8_admission", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint folder (python -m qasr.model.testmodel makes one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-clips", type=int, default=4096)
    p.add_argument("--clip-seconds", type=float, default=10.9)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--max-len", type=int, default=320)
    p.add_argument("--prefill-tokens", type=int, default=65536)
    p.add_argument("--runs", type=int, default=3, help="throughput runs of each engine, alternating")
    p.add_argument("--latency-runs", type=int, default=10)
    p.add_argument("--agreement-clips", type=int, default=256, help="clips decoded by both engines and compared")
    p.add_argument("--min-rows", type=int, default=fp8.MIN_ROWS, help="products of fewer rows stay bfloat16")
    args = p.parse_args(argv)

    options = offline_options(args.slots, args.max_len, args.prefill_tokens)
    engines = {"bf16": build(args.model, args.device, "bfloat16", options, None),
               "fp8": build(args.model, args.device, "bfloat16", options, args.min_rows)}
    frozen = freeze_loaded_heap()  # as qasr-transcribe and the engine process do: no full collection mid-run
    clips = [speech_like(args.clip_seconds, seed=100 + i) for i in range(args.num_clips)]
    summary: dict = {"frozen_objects": frozen, "min_rows": args.min_rows,
                     "fp8_products": len(fp8.quantized(engines["fp8"].model))}
    for name, engine in engines.items():
        engine.transcribe(requests(clips[: args.slots], args.tokens))  # warm the prefill/encoder shapes
        summary[f"{name}_bs1_latency_ms"] = latency_ms(engine, speech_like(args.clip_seconds, seed=1), args.tokens,
                                                      args.latency_runs)
    some = clips[: args.agreement_clips]
    summary["fp8_vs_bf16"] = agreement(engines["bf16"].transcribe(requests(some, args.tokens)),
                                       engines["fp8"].transcribe(requests(some, args.tokens)))
    rows = engines["fp8"].transcribe(requests([clips[0]] * args.slots, args.tokens))
    summary["fp8_identical_rows"] = all(r.token_ids == rows[0].token_ids for r in rows)

    records = []
    for run in range(args.runs):
        for name, engine in engines.items():
            record = {"run": run, "engine": name, **throughput_run(engine, clips, args.tokens, args.clip_seconds)}
            print(json.dumps(record), flush=True)
            records.append(record)
    for name in engines:
        mine = [r["qasr_throughput_audio_s_per_s"] for r in records if r["engine"] == name]
        summary[f"{name}_audio_s_per_s"] = [round(x) for x in mine]
        summary[f"{name}_median"] = round(statistics.median(mine))
    summary["fp8_over_bf16"] = round(summary["fp8_median"] / summary["bf16_median"], 3)
    print(json.dumps({"summary": summary}, indent=1))
    thaw()


if __name__ == "__main__":
    main()
