"""The front end's cost per wire protocol, as a Markdown table, from the `qasr-bench stream --out` files of
bench/frontend_protocols.sh (any folder of them will do):

    python -m qasr.bench.frontend_table OUTDIR

One row per protocol (with its tracks and audio per message) and stream count, over its repeated runs: the server's
CPU per second of audio (median and the spread over runs), per stream, its ratio to the native protocol's at 100 ms
per message and the same stream count (the ratio of the medians), latencies, and every failure. Runs of different
durations or speeds are not mixed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

BASE_CHUNK_MS = 100  # the ratio column compares with the native protocol at this much audio per message (the default)


def load_runs(folder: Path) -> list[dict]:
    runs = []
    for path in sorted(folder.glob("*.json")):
        run = json.loads(path.read_text())
        if isinstance(run, dict) and "config" in run and "totals" in run:  # a stream bench result
            runs.append(run)
    return runs


def label(config: dict) -> str:
    """"native, 100 ms": the protocol (with its tracks) and the audio per message (twilio: the pacing of its 20 ms
    frames, which it always sends one per message)."""
    tracks = config.get("tracks", 1)
    return (config.get("protocol", "native") + (f" ({tracks} tracks)" if tracks > 1 else "")
            + f", {config.get('chunk_ms', BASE_CHUNK_MS)} ms")


def rows(runs: list[dict]) -> list[dict]:
    """One row per (protocol, tracks, streams, duration, speed), native first, then by stream count."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        config = run["config"]
        key = (label(config), config["clients"], config["duration_s"], config["speed"])
        groups.setdefault(key, []).append(run)
    out = []
    for (name, clients, duration, speed), group in groups.items():
        measured = [run for run in group if run["server_cpu"] and run["server_cpu"].get("cpu_ms_per_audio_second")]
        per_audio = [run["server_cpu"]["cpu_ms_per_audio_second"] for run in measured]
        per_stream = [run["server_cpu"]["percent_of_one_core_per_stream"] for run in measured]
        out.append({
            "protocol": name, "streams": clients, "duration_s": duration, "speed": speed, "runs": len(group),
            "cpu_ms_per_audio_s": statistics.median(per_audio) if per_audio else None,
            "cpu_ms_per_audio_s_range": (min(per_audio), max(per_audio)) if per_audio else None,
            "percent_per_stream": statistics.median(per_stream) if per_stream else None,
            "final_p50_ms": _median_of(group, "final_latency_ms", "p50"),
            "final_p95_ms": _median_of(group, "final_latency_ms", "p95"),
            "send_lag_p99_ms": _median_of(group, "send_lag_ms", "p99"),
            "failed_clients": sum(run["totals"]["failed_clients"] for run in group),
            "finals": sum(run["totals"]["finals"] for run in group),
            "missing_or_extra_finals": sum(run["totals"].get("missing_finals", 0) + run["totals"].get("extra_finals", 0)
                                           for run in group),
        })
    native = {(row["streams"], row["duration_s"], row["speed"]): row["cpu_ms_per_audio_s"]
              for row in out if row["protocol"] == f"native, {BASE_CHUNK_MS} ms"}
    for row in out:
        base = native.get((row["streams"], row["duration_s"], row["speed"]))
        row["vs_native"] = row["cpu_ms_per_audio_s"] / base if base and row["cpu_ms_per_audio_s"] else None
    return sorted(out, key=lambda row: (row["streams"], row["protocol"] != f"native, {BASE_CHUNK_MS} ms",
                                        row["protocol"]))


def _median_of(group: list[dict], metric: str, stat: str) -> float | None:
    values = [run["summary"][metric][stat] for run in group if run["summary"][metric].get("n")]
    return statistics.median(values) if values else None


def markdown(table: list[dict]) -> str:
    def number(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| protocol | streams | runs | server CPU ms per audio s: median (min-max) | % of a core per stream "
             "| vs native | final p50 / p95 ms | send lag p99 ms | failed clients | finals (missing or extra) |",
             "|---|---:|---:|---|---:|---:|---|---:|---:|---|"]
    for row in table:
        spread = row["cpu_ms_per_audio_s_range"]
        cpu = number(row["cpu_ms_per_audio_s"]) + (f" ({spread[0]:.1f}-{spread[1]:.1f})" if spread else "")
        vs = "-" if row["vs_native"] is None else f"{row['vs_native']:.2f}x"
        lines.append(f"| {row['protocol']} | {row['streams']} | {row['runs']} | {cpu} "
                     f"| {number(row['percent_per_stream'], 2)} | {vs} "
                     f"| {number(row['final_p50_ms'])} / {number(row['final_p95_ms'])} "
                     f"| {number(row['send_lag_p99_ms'])} | {row['failed_clients']} "
                     f"| {row['finals']} ({row['missing_or_extra_finals']}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m qasr.bench.frontend_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a folder of qasr-bench stream --out JSON files")
    args = parser.parse_args(argv)
    runs = load_runs(args.folder)
    if not runs:
        parser.error(f"{args.folder}: no qasr-bench stream results (*.json) there")
    text = markdown(rows(runs))
    print(text)
    return text


if __name__ == "__main__":
    main()
