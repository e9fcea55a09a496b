"""Offline throughput under several scheduling options, in one process on one lease (#16).

    python -m qasr.bench.offline_sweep --model DIR --num-clips 1024 --runs 3 \
        --vary max_prefill_tokens=8192,32768 --vary decode_steps_ahead=4,16

Leases differ more than most changes do (docs/benchmarks.md), and a process per setting pays the load and the graph
captures each time. Here one engine is loaded once, and each run of the options the engine reads at every step
(max_prefill_tokens, decode_steps_ahead, admission_interval_ms), or the loaded heap frozen or not (freeze_heap: 0
or 1), goes through every combination in turn, so the combinations alternate and share the lease's drift. Prints
one JSON line per timed run, then the medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics

from qasr.engine.engine import Engine
from qasr.engine.gc_pauses import freeze_loaded_heap, thaw
from qasr.engine.options import MINIMUMS

from .cli import offline_parser
from .offline import offline_options, requests, throughput_run
from .synthetic import speech_like

VARIABLE = ("max_prefill_tokens", "decode_steps_ahead", "admission_interval_ms", "freeze_heap")
SWITCHES = ("freeze_heap",)  # 0 or 1; freeze_heap is not an engine option: the loaded heap frozen for the run
# (gc.freeze, as the server's engine process does) or left to the collector


def parse_vary(text: str) -> tuple[str, list[float]]:
    """'name=v1,v2' -> (name, [v1, v2]), the name one of VARIABLE."""
    name, _, values = text.partition("=")
    if name not in VARIABLE or not values:
        raise argparse.ArgumentTypeError(f"--vary takes NAME=V1,V2,... with NAME one of {', '.join(VARIABLE)}")
    if name in SWITCHES:  # on or off
        if not set(values.split(",")) <= {"0", "1"}:
            raise argparse.ArgumentTypeError(f"--vary {name}: values must be 0 or 1, got {values!r}")
        return name, [v == "1" for v in values.split(",")]
    kind = float if name == "admission_interval_ms" else int
    try:
        parsed = [kind(v) for v in values.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--vary {name}: values must be numbers, got {values!r}") from None
    if min(parsed) < MINIMUMS[name]:  # refused now, not after the model has loaded
        raise argparse.ArgumentTypeError(f"--vary {name}: values must be >= {MINIMUMS[name]}, got {values!r}")
    return name, parsed


def combinations(varied: list[tuple[str, list[float]]]) -> list[dict]:
    names = [name for name, _ in varied]
    return [dict(zip(names, values)) for values in itertools.product(*(values for _, values in varied))]


def sweep(engine: Engine, clips, tokens: int, clip_seconds: float, settings: list[dict], runs: int) -> list[dict]:
    """Every setting once per run, in turn -> a record per timed run."""
    base = engine.options
    records = []
    for run in range(runs):
        for setting in settings:
            options = {name: value for name, value in setting.items() if name != "freeze_heap"}
            engine.options = dataclasses.replace(base, **options)
            frozen = setting.get("freeze_heap")
            if frozen:
                freeze_loaded_heap()
            try:
                record = {"run": run, **setting, **throughput_run(engine, clips, tokens, clip_seconds)}
            finally:
                if frozen:
                    thaw()
            print(json.dumps(record), flush=True)
            records.append(record)
    engine.options = base
    return records


def medians(records: list[dict], settings: list[dict]) -> list[dict]:
    out = []
    for setting in settings:
        mine = [r for r in records if all(r[k] == v for k, v in setting.items())]
        out.append({**setting, "audio_s_per_s": [round(r["qasr_throughput_audio_s_per_s"]) for r in mine],
                    "median": statistics.median(r["qasr_throughput_audio_s_per_s"] for r in mine)})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m qasr.bench.offline_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint folder (python -m qasr.model.testmodel makes one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-clips", type=int, default=1024)
    p.add_argument("--clip-seconds", type=float, default=10.9)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--max-len", type=int, default=320)
    p.add_argument("--runs", type=int, default=3, help="times through every combination (default: %(default)s)")
    p.add_argument("--vary", type=parse_vary, action="append", default=[], metavar="NAME=V1,V2",
                   help=f"an option and its values, one of {', '.join(VARIABLE)}; combinations of all are run")
    args = p.parse_args(argv)
    if args.runs < 1 or args.num_clips < 1:
        p.error("--runs and --num-clips must be at least 1")
    settings = combinations(args.vary) if args.vary else [{}]
    options = offline_options(args.slots, args.max_len, offline_parser().get_default("prefill_tokens"))
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, options=options)
    clips = [speech_like(args.clip_seconds, seed=100 + i) for i in range(args.num_clips)]
    engine.transcribe(requests(clips[: args.slots], args.tokens))  # warm the prefill/encoder shapes
    records = sweep(engine, clips, args.tokens, args.clip_seconds, settings, args.runs)
    print(json.dumps({"medians": medians(records, settings)}, indent=1))


if __name__ == "__main__":
    main()
