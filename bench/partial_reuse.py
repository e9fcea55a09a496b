"""What partial reuse saves: one segment growing to 30 s, a partial every second, decoded with and without reuse.

    qasr-bench partial-reuse                       # tiny random model, on this machine's device
    qasr-bench partial-reuse --size 0.6B --out reuse.json

With reuse (the partials carry a stream id) the engine keeps the stream's whole 8 s encoder windows and the decoder KV
of the prompt prefix + those windows, and prefills only what is new; without (no stream id) every partial encodes and
prefills the whole segment so far. With reuse a partial also computes the mel of the chunk in progress and the new
audio only, and convolves only those chunks (engine/audio_frontend.py). Prints, per partial and in total, the encoder
windows computed, the prompt positions prefilled and the wall time, from `engine.counters`; then, at the --at segment
lengths, the admission of that partial (wall and process CPU ms, median of --repeats runs) with the mel frames and
conv chunks it computed. Decoding is forced to --tokens tokens per partial and
partials carry no text prefix, so both runs do the same decode work and differ only in what reuse saves. Random
weights: the transcripts are meaningless, the work is real.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from qasr.model import audio as qaudio
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest, Priority

from .synthetic import speech_like

COUNTERS = ("encoded_windows", "reused_windows", "prefill_tokens", "reused_tokens", "mel_frames", "conv_chunks",
            "floor_moves")


def time_admissions(engine: Engine) -> list[float]:
    """Record the process CPU seconds of each admission (mel, encoder, prefill) from now on -> the list it fills.
    Process CPU, not wall: on a shared machine it is what the admission cost, whoever else runs."""
    spent: list[float] = []
    admit = engine._admit

    def timed_admit() -> None:
        start = time.process_time()
        admit()
        spent.append(time.process_time() - start)

    engine._admit = timed_admit
    return spent


def run_partials(engine: Engine, audio: np.ndarray, ends: list[int], tokens: int, stream_id: str | None,
                 admissions: list[float] | None = None) -> list[dict]:
    """One partial per end sample, in order, each alone in the engine -> per partial: counters, wall ms, tokens.
    admissions: what time_admissions(engine) returned, for the admission's CPU time (else 0)."""
    rows = []
    admissions = [] if admissions is None else admissions
    for end in ends:
        before = dict(engine.counters)
        started = time.perf_counter()
        request = DecodeRequest(audio=audio[:end], priority=Priority.PARTIAL, stream_id=stream_id,
                                max_new_tokens=tokens)
        del admissions[:]
        result = engine.transcribe([request])[0]
        row = {key: engine.counters.get(key, 0) - before.get(key, 0) for key in COUNTERS}  # older engines lack some
        row.update(seconds=end / qaudio.SAMPLE_RATE, wall_ms=(time.perf_counter() - started) * 1e3,
                   admit_ms=result.timings["encode_ms"] + result.timings["prefill_ms"],  # what reuse can shorten
                   encode_ms=result.timings["encode_ms"], admit_cpu_ms=sum(admissions) * 1e3,
                   token_ids=list(result.token_ids))
        rows.append(row)
    if stream_id is not None:
        engine.release_stream(stream_id)
        engine.step()  # applies the release
    return rows


def totals(rows: list[dict]) -> dict:
    return {key: sum(row[key] for row in rows) for key in (*COUNTERS, "admit_ms", "wall_ms")}


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Per partial, the median of each timing over the runs (the counters and tokens are the same in every run)."""
    timed = ("wall_ms", "admit_ms", "encode_ms", "admit_cpu_ms")
    return [{**rows[0], **{key: float(np.median([row[key] for row in rows])) for key in timed}}
            for rows in zip(*runs)]


def print_admissions(out: dict) -> None:
    print(f"admission of the partial at each length (median of {out['repeats']} runs): encode = mel + conv + encoder "
          f"(wall), admit = encode + prefill (wall), cpu = the admission's process CPU")
    print(f"{'audio s':>8} | {'encode':>7} {'admit':>7} {'cpu':>7} {'mel fr':>6} {'chunks':>6} | {'encode':>7} "
          f"{'admit':>7} {'cpu':>7} {'mel fr':>6} {'chunks':>6} {'windows':>7} {'kept':>4}")
    print(f"{'':>8} | {'without reuse (ms)':^38} | {'with reuse (ms)':^55}")
    for seconds in out["at"]:
        a = next((row for row in out["without_reuse"] if abs(row["seconds"] - seconds) < 1e-6), None)
        b = next((row for row in out["with_reuse"] if abs(row["seconds"] - seconds) < 1e-6), None)
        if a is None or b is None:
            print(f"{seconds:8.1f} | no partial at this length (partials every {out['interval_seconds']:g} s)")
            continue
        print(f"{seconds:8.1f} | {a['encode_ms']:7.1f} {a['admit_ms']:7.1f} {a['admit_cpu_ms']:7.1f} "
              f"{a['mel_frames']:6d} {a['conv_chunks']:6d} | {b['encode_ms']:7.1f} {b['admit_ms']:7.1f} "
              f"{b['admit_cpu_ms']:7.1f} {b['mel_frames']:6d} {b['conv_chunks']:6d} {b['encoded_windows']:7d} "
              f"{b['reused_windows']:4d}")
    moved = [row["seconds"] for row in out["with_reuse"] if row["floor_moves"]]
    print(f"partials whose rising clip maximum moved the mel floor into kept chunks (recomputed): {len(moved)}"
          + (f" (at {', '.join(f'{s:g}' for s in moved)} s)" if moved else ""))


def print_report(out: dict) -> None:
    print(f"# partial reuse: {out['segment_seconds']:g} s segment, a partial every {out['interval_seconds']:g} s, "
          f"{out['tokens']} tokens each; model {out['model']} on {out['device']} ({out['dtype']})")
    print("windows: encoder windows computed (kept: reused); prefill: prompt positions prefilled (copied: from the "
          "retained KV); admit ms: mel + encoder + prefill; wall ms: the whole partial, decode included")
    print(f"{'audio s':>8} | {'windows':>7} {'prefill':>7} {'admit ms':>8} {'wall ms':>8} | {'windows':>7} "
          f"{'kept':>4} {'prefill':>7} {'copied':>6} {'admit ms':>8} {'wall ms':>8} | same tokens")
    print(f"{'':>8} | {'without reuse':^33} | {'with reuse':^47} |")
    for a, b in zip(out["without_reuse"], out["with_reuse"]):
        print(f"{a['seconds']:8.1f} | {a['encoded_windows']:7d} {a['prefill_tokens']:7d} {a['admit_ms']:8.1f} "
              f"{a['wall_ms']:8.1f} | {b['encoded_windows']:7d} {b['reused_windows']:4d} {b['prefill_tokens']:7d} "
              f"{b['reused_tokens']:6d} {b['admit_ms']:8.1f} {b['wall_ms']:8.1f} | {a['token_ids'] == b['token_ids']}")
    a, b = out["totals"]["without_reuse"], out["totals"]["with_reuse"]
    print(f"{'total':>8} | {a['encoded_windows']:7d} {a['prefill_tokens']:7d} {a['admit_ms']:8.1f} "
          f"{a['wall_ms']:8.1f} | {b['encoded_windows']:7d} {b['reused_windows']:4d} {b['prefill_tokens']:7d} "
          f"{b['reused_tokens']:6d} {b['admit_ms']:8.1f} {b['wall_ms']:8.1f} |")
    saved = out["saved"]
    print(f"saved: {saved['encoded_windows']:.0%} of encoder windows, {saved['prefill_tokens']:.0%} of prefilled "
          f"positions, {saved['admit']:.0%} of admit time, {saved['wall']:.0%} of wall time; identical tokens in "
          f"{out['identical_partials']}/{len(out['with_reuse'])} partials")


def run(args) -> dict:
    from qasr.model.checkpoint import resolve_device
    from qasr.model.testmodel import make_test_model

    device = resolve_device(args.device)
    sample_rate = qaudio.SAMPLE_RATE
    audio = speech_like(args.seconds, seed=args.seed)
    if not args.no_loud_start:
        audio[sample_rate // 2 : sample_rate] *= 3.0  # the loudest stretch in the first second: the mel floor stays put
    step = int(round(args.interval * sample_rate))
    ends = list(range(step, len(audio) + 1, step))
    options = EngineOptions(num_slots=1, max_len=args.max_len, num_retained=1, ignore_eos=True, repetition_window=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else make_test_model(Path(tmp) / "model", size=args.size)
        engine = Engine.from_pretrained(str(model_dir), device=device, dtype=args.dtype, options=options)
        run_partials(engine, audio, ends, args.tokens, stream_id=None)  # warm-up: first-time shapes cost extra
        runs_without, runs_with, admissions = [], [], time_admissions(engine)
        for _ in range(max(1, args.repeats)):
            runs_without.append(run_partials(engine, audio, ends, args.tokens, None, admissions))
            runs_with.append(run_partials(engine, audio, ends, args.tokens, "bench", admissions))
        without, with_reuse = median_rows(runs_without), median_rows(runs_with)
    sums = {"without_reuse": totals(without), "with_reuse": totals(with_reuse)}
    out = {
        "model": args.model or f"random {args.size}", "device": str(device),
        "dtype": str(engine.model.dtype).replace("torch.", ""),
        "segment_seconds": args.seconds, "interval_seconds": args.interval, "tokens": args.tokens,
        "repeats": max(1, args.repeats), "at": [float(x) for x in args.at.split(",") if x.strip()],
        "date": time.strftime("%Y-%m-%d"),
        "without_reuse": without, "with_reuse": with_reuse, "totals": sums,
        "saved": {
            "encoded_windows": 1 - sums["with_reuse"]["encoded_windows"] / sums["without_reuse"]["encoded_windows"],
            "prefill_tokens": 1 - sums["with_reuse"]["prefill_tokens"] / sums["without_reuse"]["prefill_tokens"],
            "admit": 1 - sums["with_reuse"]["admit_ms"] / sums["without_reuse"]["admit_ms"],
            "wall": 1 - sums["with_reuse"]["wall_ms"] / sums["without_reuse"]["wall_ms"],
        },
        "identical_partials": sum(a["token_ids"] == b["token_ids"] for a, b in zip(without, with_reuse)),
    }
    print_report(out)
    print_admissions(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    """`qasr-bench partial-reuse`; its options are declared in qasr.bench.cli, where --help needs no torch."""
    from .cli import partial_reuse_parser

    run(partial_reuse_parser().parse_args(argv))


if __name__ == "__main__":
    main()
