"""Admissions overlapped with decode steps, off and on, on one engine under a live-like load (#15).

    python -m qasr.bench.admission_overlap --size 0.6B --device cuda --out OUT     # random 0.6B, ~2 min on an H200
    python -m qasr.bench.admission_overlap --steps 20 --rows 4 --streams 4          # tiny random model, CPU: a check

`--rows` finals decode throughout (forced tokens, as the stream bench's --ignore-eos); every `--every` steps the
next `--per-admission` of `--streams` streams ask for a partial whose audio is one second longer than their last
(up to `--max-seconds`, then the stream starts a new segment), `--tokens` tokens each. The same load runs with
`Engine.overlap_admissions` off (admit, then decode: the order before the overlap) and on, alternating for
`--rounds`. Per run: decode steps per second, where the engine thread's time went (engine.seconds: admit,
decode_gpu = launching and waiting for the step, decode_host), the host's waits for the device per step
(runner.host_reads; one read takes all the steps of a launch, so on CUDA, with steps queued beside admissions
(--decode-steps-ahead), it falls below 1 by design) and the partials' engine latency (timings engine_ms, submit to result) p50/p90. Writes
OUT/admission_overlap.json. Random weights: the transcripts are meaningless, the work is real.

`--sync-audit` (CUDA): the runs with the overlap on also run under torch's sync debug mode, and every call that made
the host wait for the device is counted by where it came from (its innermost qasr frames). Two are meant: the
decode step's read (runner.read_decode) and the mel's chunk extremes (runner.chunk_extremes); any other is a wait
to remove (a scalar or list copied from pageable memory, an .item(), a .tolist()).

`--phases`: the runs with the overlap on also time the engine thread by phase (PHASES: the admission's host side
piece by piece, the decode step's launch and read, the postprocess), in ms an admission and as a share of the run:
which piece of an admission holds the thread (session 9: 55% of it at 1,000 streams, not in Python).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import tempfile
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest, Priority
from qasr.model import audio as qaudio

from .synthetic import speech_like

SECONDS_KEYS = ("admit", "decode_gpu", "decode_host")


def run_load(engine: Engine, args, overlap: bool, round_index: int) -> dict:
    """One run of the load -> its figures."""
    engine.overlap_admissions = overlap
    rate = qaudio.SAMPLE_RATE
    audio = speech_like(args.max_seconds + 1, seed=args.seed)
    background = [engine.add(DecodeRequest(audio=audio[: 4 * rate], max_new_tokens=10**6), lambda r: None)
                  for _ in range(args.rows)]
    while len(engine.scheduler):  # the background rows admitted before the clock starts
        engine.step()
    latencies: list[float] = []
    seconds_before, reads_before, steps_before = dict(engine.seconds), engine.runner.host_reads, engine.steps
    heard = [0] * args.streams  # seconds of audio each stream's last partial had
    segment = [0] * args.streams
    asked = 0
    started = time.perf_counter()
    for step in range(args.steps):
        if step % args.every == 0:
            for _ in range(args.per_admission):
                i = asked % args.streams
                asked += 1
                heard[i] += 1
                if heard[i] > args.max_seconds:  # the segment ended: a new one of the stream
                    engine.release_stream(f"r{round_index}-{overlap}-s{i}-{segment[i]}")
                    heard[i], segment[i] = 1, segment[i] + 1
                request = DecodeRequest(audio=audio[: heard[i] * rate], priority=Priority.PARTIAL,
                                        stream_id=f"r{round_index}-{overlap}-s{i}-{segment[i]}",
                                        max_new_tokens=args.tokens)
                engine.add(request, lambda r: latencies.append(r.timings["engine_ms"]) if hasattr(r, "timings")
                           else None)
        engine.step()
    wall = time.perf_counter() - started
    steps = engine.steps - steps_before
    spent = {key: engine.seconds[key] - seconds_before.get(key, 0.0) for key in SECONDS_KEYS}
    reads = engine.runner.host_reads - reads_before
    for seq in background:
        seq.cancelled = True
    engine.run_until_done()
    for i in range(args.streams):
        engine.release_stream(f"r{round_index}-{overlap}-s{i}-{segment[i]}")
    engine.step()
    busy = sum(spent.values()) or 1.0
    return {"overlap": overlap, "round": round_index, "wall_s": wall, "steps": steps,
            "steps_per_s": steps / wall, "partials_asked": asked, "partials_answered": len(latencies),
            "seconds": spent, "share": {key: spent[key] / busy for key in SECONDS_KEYS},
            "host_reads_per_step": reads / max(1, steps),
            "partial_engine_ms": {"p50": float(np.percentile(latencies, 50)) if latencies else None,
                                  "p90": float(np.percentile(latencies, 90)) if latencies else None}}


# where the engine thread's time goes inside a step, by the method it is in (--phases): (phase, owner, method). The
# owners are the engine's own objects; mel includes mel_read, the host's wait for the mel's chunk extremes
PHASES = (("prepare", "engine", "_prepare"), ("mel", "frontend", "_log_spectrogram"),
          ("mel_read", "runner", "chunk_extremes"), ("floor", "frontend", "_floored"),
          ("mel_finals", "frontend", "_whole_clip_features"),  # an admission of finals only: mel and floor, no read
          ("conv", "frontend", "_conv_tokens"),
          ("encoder", "frontend", "_encode"), ("prompts", "runner", "embed_prompts"), ("prefill", "runner", "prefill"),
          ("start_rows", "runner", "start_rows"), ("launch", "runner", "launch_decode"), ("read", "runner", "read_decode"),
          ("postprocess", "engine", "_postprocess"), ("admissions", "engine", "_admit_together"))


@contextlib.contextmanager
def phase_timers(engine: Engine, phases=PHASES):
    """Times the `phases`' methods ((phase, owner, method), as PHASES) on this engine while inside -> {phase: [calls,
    wall seconds]} (filled as it runs). Instance attributes shadow the methods and are removed after."""
    owners = {"engine": engine, "frontend": engine.frontend, "runner": engine.runner}
    spent = {phase: [0, 0.0] for phase, _, _ in phases}

    def timed(phase, method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[phase][0] += 1
                spent[phase][1] += time.perf_counter() - start
        return call

    for phase, owner, name in phases:
        setattr(owners[owner], name, timed(phase, getattr(owners[owner], name)))
    try:
        yield spent
    finally:
        for _, owner, name in phases:
            delattr(owners[owner], name)


def qasr_frames() -> list[str]:
    """The caller's stack, innermost first, as "file:line function" for the frames of qasr's own modules (not the
    benches' or the tests')."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("qasr.") and not module.startswith(("qasr.bench", "qasr.tests")):
            frames.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return frames


def audit_syncs(fn, cuda: bool = True):
    """fn() under CUDA's sync debug mode -> (its result, {call site: times the host waited for the device there}).
    A site is the innermost three qasr frames (outside bench/ and tests/) of the call that synchronized. cuda=False: only the
    warnings fn raises itself (the tests, on a CPU)."""
    import torch

    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        sites[" <- ".join(qasr_frames()[:3])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    return result, dict(sites.most_common())


def phase_table(spent: dict, wall_s: float) -> dict:
    """{phase: calls, ms a call, ms an admission, share of `wall_s` (the time the timers were on)}."""
    admissions = max(1, spent["admissions"][0])
    return {phase: {"calls": n, "ms_per_call": s / n * 1e3 if n else 0.0, "ms_per_admission": s / admissions * 1e3,
                    "share": s / wall_s} for phase, (n, s) in spent.items()}


def print_phases(table: dict) -> None:
    print("  engine thread by phase (ms an admission, share of the run):",
          ", ".join(f"{phase} {v['ms_per_admission']:.2f} ({v['share']:.0%})" for phase, v in table.items()))


def print_run(row: dict) -> None:
    lat = row["partial_engine_ms"]
    fmt = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
    print(f"overlap {'on ' if row['overlap'] else 'off'} round {row['round']}: {row['steps_per_s']:.0f} steps/s, "
          + ", ".join(f"{k} {row['share'][k]:.0%}" for k in SECONDS_KEYS)
          + f", host waits/step {row['host_reads_per_step']:.2f}, partials {row['partials_answered']}/"
          f"{row['partials_asked']} engine ms p50 {fmt(lat['p50'])} p90 {fmt(lat['p90'])}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qasr.bench.admission_overlap", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: a random --size model, made here)")
    p.add_argument("--size", default="tiny", help="random model size when no --model: tiny, 0.6B, 1.7B")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="default: the checkpoint's (bfloat16 for --size 0.6B)")
    p.add_argument("--rows", type=int, default=128, help="finals decoding throughout")
    p.add_argument("--streams", type=int, default=256, help="streams asking for partials in turn")
    p.add_argument("--per-admission", type=int, default=16, help="partials asked every --every steps")
    p.add_argument("--every", type=int, default=2, help="steps between two batches of partials")
    p.add_argument("--tokens", type=int, default=8, help="tokens each partial decodes")
    p.add_argument("--max-seconds", type=int, default=12, help="a stream's segment grows to this, then restarts")
    p.add_argument("--steps", type=int, default=400, help="decode steps per run (the finals' budgets last ~560)")
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-audit", action="store_true",
                   help="CUDA: count where the host waited for the device in the runs with the overlap on")
    p.add_argument("--phases", action="store_true",
                   help="time the engine thread's phases (PHASES) in the runs with the overlap on")
    p.add_argument("--out", default=None, help="folder for admission_overlap.json")
    return p


def run(args) -> dict:
    if args.phases and args.sync_audit:  # the audit's warnings would be timed with the phases
        raise SystemExit("--phases and --sync-audit each run the overlapped load their own way: give one")
    from qasr.model.checkpoint import resolve_device
    from qasr.model.testmodel import make_test_model

    device = resolve_device(args.device)
    options = EngineOptions(num_slots=args.slots, max_len=640, num_retained=args.streams, ignore_eos=True,
                            base_tokens=0, tokens_per_second=3.7, repetition_window=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else make_test_model(
            Path(tmp) / "model", size=args.size, dtype="float32" if args.size == "tiny" else "bfloat16")
        engine = Engine.from_pretrained(str(model_dir), device=device, dtype=args.dtype, options=options)
        warm = argparse.Namespace(**{**vars(args), "steps": min(args.steps, 50)})
        run_load(engine, warm, True, -1)  # first-use costs (shapes, allocator) outside the figures
        rows = []
        for r in range(max(1, args.rounds)):
            for overlap in (False, True):
                if overlap and args.sync_audit and device.type == "cuda":
                    row, syncs = audit_syncs(lambda: run_load(engine, args, overlap, r))
                    row["syncs"] = syncs
                    print("  host waited for the device at:", *(f"    {n:6d}  {site}" for site, n in syncs.items()),
                          sep="\n")
                elif overlap and args.phases:
                    started = time.perf_counter()
                    with phase_timers(engine) as spent:  # the run's setup and wind-down too: shares of all of it
                        row = run_load(engine, args, overlap, r)
                    row["phases"] = phase_table(spent, time.perf_counter() - started)
                    print_phases(row["phases"])
                else:
                    row = run_load(engine, args, overlap, r)
                rows.append(row)
                print_run(rows[-1])
    out = {"model": args.model or f"random {args.size}", "device": str(device), "date": time.strftime("%Y-%m-%d"),
           "config": {k: v for k, v in vars(args).items() if k != "out"}, "runs": rows}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "admission_overlap.json").write_text(json.dumps(out, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    run(parser().parse_args(argv))


if __name__ == "__main__":
    main()
