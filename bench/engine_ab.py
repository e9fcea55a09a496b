"""Engines that differ in their options, on one loaded model, their offline throughput runs alternating (#16).

    python -m qasr.bench.engine_ab --model DIR --num-clips 2048 --slots 512 --runs 3 \
        --variant bf16 --variant int8:kv_int8=1 --variant fp8:fp8_prefill=1

Options fixed when an engine is built (the KV cache's format, FP8 products) cannot be swept on one engine as
bench.offline_sweep sweeps the scheduling options. Here each variant is its own Engine on the same weights (the load
paid once), and every run goes through the variants in turn, so they share the lease's drift. The first variant is
the reference: each other's tokens are compared with its tokens on the same clips (decoding forced, so a row that
differs once differs after), and each variant's identical clips must give identical rows. Prints one JSON line per
timed run, then a summary with the medians and their ratios to the reference's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from qasr.engine.engine import Engine
from qasr.engine.gc_pauses import freeze_loaded_heap, thaw
from qasr.engine.options import EngineOptions
from qasr.model.checkpoint import load_model
from qasr.model.tokenizer import Tokenizer

from .cli import offline_parser
from .offline import offline_options, requests, throughput_run
from .synthetic import speech_like

FIELDS = {f.name: f for f in dataclasses.fields(EngineOptions)}


def parse_variant(text: str) -> tuple[str, dict]:
    """'NAME' or 'NAME:FIELD=VALUE,...' -> (NAME, {field: value}), each FIELD an EngineOptions field and VALUE parsed
    as its default's type (a bool as 0 or 1)."""
    name, _, spec = text.partition(":")
    overrides = {}
    for item in filter(None, spec.split(",")):
        field, _, value = item.partition("=")
        if field not in FIELDS or not value:
            raise argparse.ArgumentTypeError(f"--variant {text!r}: {item!r} is not FIELD=VALUE with FIELD one of "
                                             f"EngineOptions' fields")
        kind = type(FIELDS[field].default)
        if kind is bool:
            if value not in ("0", "1"):
                raise argparse.ArgumentTypeError(f"--variant {text!r}: {field} takes 0 or 1, got {value!r}")
            overrides[field] = value == "1"
        else:
            try:
                overrides[field] = kind(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"--variant {text!r}: {field} takes a {kind.__name__}, "
                                                 f"got {value!r}") from None
    if not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: a variant needs a name")
    return name, overrides


def agreement(reference: list, other: list) -> dict:
    """Tokens of `other` against `reference`, request by request (the same clips in the same order)."""
    same = sum(sum(a == b for a, b in zip(r.token_ids, o.token_ids)) for r, o in zip(reference, other))
    return {"exact_match": f"{sum(r.token_ids == o.token_ids for r, o in zip(reference, other))}/{len(reference)}",
            "token_agreement": same / max(1, sum(len(r.token_ids) for r in reference))}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m qasr.bench.engine_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint folder (python -m qasr.model.testmodel makes one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-clips", type=int, default=2048)
    p.add_argument("--clip-seconds", type=float, default=10.9)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--max-len", type=int, default=320)
    p.add_argument("--prefill-tokens", type=int, default=offline_parser().get_default("prefill_tokens"))
    p.add_argument("--runs", type=int, default=3, help="times through every variant (default: %(default)s)")
    p.add_argument("--agreement-clips", type=int, default=256, help="clips every variant decodes for the comparison")
    p.add_argument("--variant", type=parse_variant, action="append", required=True, metavar="NAME[:FIELD=VALUE,...]",
                   help="an engine: its name and the EngineOptions it changes; the first is the reference")
    args = p.parse_args(argv)
    if args.runs < 1 or args.num_clips < 1 or len(args.variant) < 2:
        p.error("--runs and --num-clips must be at least 1, and there must be two variants or more")

    model = load_model(args.model, device=args.device, dtype=args.dtype)
    tokenizer = Tokenizer.from_pretrained(args.model)
    base = offline_options(args.slots, args.max_len, args.prefill_tokens)
    engines = {name: Engine(model, tokenizer, dataclasses.replace(base, **overrides))
               for name, overrides in args.variant}
    clips = [speech_like(args.clip_seconds, seed=100 + i) for i in range(args.num_clips)]
    summary: dict = {"variants": {name: overrides for name, overrides in args.variant}}
    some = clips[: args.agreement_clips]
    outputs = {}
    for name, engine in engines.items():
        engine.transcribe(requests(clips[: args.slots], args.tokens))  # warm the prefill and encoder shapes
        outputs[name] = engine.transcribe(requests(some, args.tokens))
        copies = engine.transcribe(requests([clips[0]] * min(args.slots, 64), args.tokens))
        summary[f"{name}_identical_rows"] = all(r.token_ids == copies[0].token_ids for r in copies)
    reference = args.variant[0][0]
    for name in engines:
        if name != reference:
            summary[f"{name}_vs_{reference}"] = agreement(outputs[reference], outputs[name])
    print(json.dumps({"checks": summary}), flush=True)  # before the runs: a run cut off at its time limit keeps them

    summary["frozen_objects"] = freeze_loaded_heap()  # as qasr-transcribe and the engine process do
    records = []
    try:
        for run in range(args.runs):
            for name, engine in engines.items():
                record = {"run": run, "variant": name,
                          **throughput_run(engine, clips, args.tokens, args.clip_seconds)}
                print(json.dumps(record), flush=True)
                records.append(record)
    finally:
        thaw()
    for name in engines:
        mine = [r["qasr_throughput_audio_s_per_s"] for r in records if r["variant"] == name]
        summary[f"{name}_audio_s_per_s"] = [round(x) for x in mine]
        summary[f"{name}_median"] = round(statistics.median(mine))
    for name in engines:
        summary[f"{name}_over_{reference}"] = round(summary[f"{name}_median"] / summary[f"{reference}_median"], 3)
    print(json.dumps({"summary": summary}, indent=1))


if __name__ == "__main__":
    main()
