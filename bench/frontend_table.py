"""The front end's cost per wire protocol, as a Markdown table, from the `qasr-bench stream --out` files of
bench/frontend_protocols.sh (any folder of them will do):

    python -m qasr.bench.frontend_table OUTDIR

One row per protocol (with its tracks, audio format and audio per message) and stream count, over its repeated runs:
the server's CPU per second of audio (median and the spread over runs), per stream, its ratio to the native
protocol's at 16 kHz and 100 ms per message and the same stream count, its ratio to native on the same audio (rate,
encoding and ms per message: what the adapter itself costs, resampling and decoding aside), latencies, and every
failure. Ratios are of the medians. Runs of different durations or speeds are not mixed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

BASE_CHUNK_MS = 100  # the ratio column compares with the native protocol at this much audio per message (the default)
BASE_FORMAT = "16000 Hz s16le"  # ... and this audio (what the model hears: nothing to resample)
PROTOCOL_FORMATS = {"native": BASE_FORMAT, "openai": "24000 Hz s16le", "twilio": "8000 Hz mulaw"}  # for results
# written before the config recorded `audio_format`


def load_runs(folder: Path) -> list[dict]:
    runs = []
    for path in sorted(folder.glob("*.json")):
        run = json.loads(path.read_text())
        if isinstance(run, dict) and "config" in run and "totals" in run:  # a stream bench result
            runs.append(run)
    return runs


def audio_format(config: dict) -> str:
    """"8000 Hz mulaw": the audio the clients sent."""
    return config.get("audio_format") or PROTOCOL_FORMATS.get(config.get("protocol", "native"), BASE_FORMAT)


def label(config: dict) -> str:
    """"native, 100 ms", "native 8 kHz mulaw, 20 ms": the protocol (with its tracks, and native's audio unless it is
    16 kHz s16le) and the audio per message (twilio: the pacing of its 20 ms frames, which it always sends one per
    message)."""
    protocol, tracks = config.get("protocol", "native"), config.get("tracks", 1)
    if protocol == "native" and audio_format(config) != BASE_FORMAT:
        rate, encoding = audio_format(config).split(" Hz ")
        protocol += f" {int(rate) / 1000:g} kHz" + (f" {encoding}" if encoding != "s16le" else "")
    return protocol + (f" ({tracks} tracks)" if tracks > 1 else "") + f", {config.get('chunk_ms', BASE_CHUNK_MS)} ms"


def rows(runs: list[dict]) -> list[dict]:
    """One row per (protocol, tracks, streams, duration, speed), native first, then by stream count."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        config = run["config"]
        key = (label(config), config["clients"], config["duration_s"], config["speed"])
        groups.setdefault(key, []).append(run)
    out = []
    for (name, clients, duration, speed), group in groups.items():
        config = group[0]["config"]
        measured = [run for run in group if run["server_cpu"] and run["server_cpu"].get("cpu_ms_per_audio_second")]
        per_audio = [run["server_cpu"]["cpu_ms_per_audio_second"] for run in measured]
        per_stream = [run["server_cpu"]["percent_of_one_core_per_stream"] for run in measured]
        out.append({
            "protocol": name, "streams": clients, "duration_s": duration, "speed": speed, "runs": len(group),
            "native_protocol": config.get("protocol", "native") == "native", "tracks": config.get("tracks", 1),
            "audio_format": audio_format(config), "chunk_ms": config.get("chunk_ms", BASE_CHUNK_MS),
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
    native = {(row["streams"], row["duration_s"], row["speed"], row["audio_format"], row["chunk_ms"]):
              row["cpu_ms_per_audio_s"] for row in out if row["native_protocol"] and row["tracks"] == 1}
    for row in out:
        load = (row["streams"], row["duration_s"], row["speed"])
        row["vs_native"] = _ratio(row["cpu_ms_per_audio_s"], native.get((*load, BASE_FORMAT, BASE_CHUNK_MS)))
        same_audio = native.get((*load, row["audio_format"], row["chunk_ms"])) if row["tracks"] == 1 else None
        row["vs_native_same_audio"] = None if row["native_protocol"] else _ratio(row["cpu_ms_per_audio_s"], same_audio)
    return sorted(out, key=lambda row: (row["streams"], row["protocol"] != f"native, {BASE_CHUNK_MS} ms",
                                        row["protocol"]))


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value and base else None


def _median_of(group: list[dict], metric: str, stat: str) -> float | None:
    values = [run["summary"][metric][stat] for run in group if run["summary"][metric].get("n")]
    return statistics.median(values) if values else None


def markdown(table: list[dict]) -> str:
    def number(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| protocol | streams | runs | server CPU ms per audio s: median (min-max) | % of a core per stream "
             "| vs native | vs native, same audio | final p50 / p95 ms | send lag p99 ms | failed clients "
             "| finals (missing or extra) |",
             "|---|---:|---:|---|---:|---:|---:|---|---:|---:|---|"]
    for row in table:
        spread = row["cpu_ms_per_audio_s_range"]
        cpu = number(row["cpu_ms_per_audio_s"]) + (f" ({spread[0]:.1f}-{spread[1]:.1f})" if spread else "")
        vs, same = ("-" if ratio is None else f"{ratio:.2f}x" for ratio in (row["vs_native"],
                                                                             row["vs_native_same_audio"]))
        lines.append(f"| {row['protocol']} | {row['streams']} | {row['runs']} | {cpu} "
                     f"| {number(row['percent_per_stream'], 2)} | {vs} | {same} "
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
