"""The front end's cost per wire protocol, measured in pairs: one front-end server (bench/frontend_server.py) per
protocol, all carrying their load at the same time, so whatever else runs on the machine slows every protocol alike
and the ratios to the first protocol hold even where the sequential runs of bench/frontend_protocols.sh drift.

    python -m qasr.bench.frontend_paired OUTDIR --streams 30 --rounds 3 native:24000 openai deepgram

Each entry is one of frontend_protocols.sh's: PROTOCOL[:RATE[-ENCODING]][@CHUNK_MS]. In round r, entry i streams to
server (i + r) mod k, so every protocol meets every server (a server's own quirks cancel over k rounds). Each
round's figure is the server process's CPU (utime + stime from /proc) per second of audio; the table gives every
protocol's ratio to the first entry's within each round, and their median and range. The clients are
`qasr-bench stream` processes of their own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SERVER_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Entry:
    """One protocol as frontend_protocols.sh names it: "openai", "native:24000", "native:8000-mulaw@20"."""

    text: str

    @property
    def protocol(self) -> str:
        return self.text.split(":")[0].split("@")[0]

    @property
    def options(self) -> list[str]:
        options = []
        head, _, chunk = self.text.partition("@")
        _, _, audio = head.partition(":")
        if audio:
            rate, _, encoding = audio.partition("-")
            options += ["--sample-rate", rate] + (["--encoding", encoding] if encoding else [])
        if chunk:
            options += ["--chunk-ms", chunk]
        return options

    @property
    def name(self) -> str:
        """For file names: native:8000-mulaw@20 -> native-8000-mulaw-c20."""
        return self.text.replace(":", "-").replace("@", "-c")


def start_servers(count: int, python: str, outdir: Path) -> list[tuple[subprocess.Popen, int, int]]:
    """`count` front-end servers, each (process, pid, port) once it has said "ready PID PORT"."""
    servers = []
    for k in range(count):
        log = open(outdir / f"server-{k}.log", "w")
        process = subprocess.Popen([python, "-m", "qasr.bench.frontend_server", "--port", "0"],
                                   stdout=subprocess.PIPE, stderr=log, text=True)
        ready = process.stdout.readline().split()
        if ready[:1] != ["ready"]:
            raise RuntimeError(f"front-end server {k} did not start (exit code {process.poll()}); see {log.name}")
        servers.append((process, int(ready[1]), int(ready[2])))
    return servers


def run_round(entries: list[Entry], servers: list, round_index: int, args, outdir: Path) -> dict[str, dict]:
    """Every entry at once, entry i on server (i + round) mod k; their `qasr-bench stream --out` results by entry."""
    clients, paths = [], {}
    for i, entry in enumerate(entries):
        _, pid, port = servers[(i + round_index) % len(servers)]
        paths[entry.text] = outdir / f"{entry.name}-{args.streams}-r{round_index + 1}.json"
        command = [args.python, "-m", "qasr.bench.stream", "--protocol", entry.protocol, *entry.options,
                   "--url", f"ws://127.0.0.1:{port}", "--clients", str(args.streams), "--duration", str(args.duration),
                   "--stagger-s", str(args.stagger_s), "--server-pid", str(pid), "--no-progress",
                   "--out", str(paths[entry.text]), *args.bench_args]
        log = open(paths[entry.text].with_suffix(".txt"), "w")
        clients.append((entry, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)))
    for entry, process in clients:
        if process.wait() != 0:
            raise RuntimeError(f"round {round_index + 1}: the {entry.text} clients exited with {process.returncode}")
    return {text: json.loads(path.read_text()) for text, path in paths.items()}


def cpu_per_audio_second(run: dict) -> float:
    cpu = run.get("server_cpu") or {}
    value = cpu.get("cpu_ms_per_audio_second")
    if value is None:
        raise ValueError("a run without the server's CPU per second of audio (was --server-pid given?)")
    if value <= 0:  # /proc counts CPU in 10 ms ticks: a light, short run can show none, and a ratio needs some
        raise ValueError("a run in which the server used less CPU than /proc measures (10 ms ticks): "
                         "run more streams or longer")
    return value


def table(entries: list[Entry], rounds: list[dict[str, dict]]) -> list[dict]:
    """Per entry: CPU ms per audio second in each round, and the ratio to the first entry in each round."""
    base = entries[0].text
    out = []
    for entry in entries:
        cpu = [cpu_per_audio_second(runs[entry.text]) for runs in rounds]
        ratios = [value / cpu_per_audio_second(runs[base]) for value, runs in zip(cpu, rounds)]
        failed = sum(runs[entry.text]["totals"]["failed_clients"] for runs in rounds)
        wrong = sum(runs[entry.text]["totals"].get("missing_finals", 0) + runs[entry.text]["totals"].get(
            "extra_finals", 0) for runs in rounds)
        out.append({"entry": entry.text, "cpu_ms_per_audio_s": cpu, "ratio": ratios,
                    "ratio_median": statistics.median(ratios), "failed_clients": failed,
                    "missing_or_extra_finals": wrong})
    return out


def markdown(rows: list[dict], streams: int) -> str:
    base = rows[0]["entry"]
    lines = [f"| protocol ({streams} streams, all at once) | server CPU ms per audio s, per round "
             f"| vs {base}: median (min-max) | failed clients | missing or extra finals |",
             "|---|---|---|---:|---:|"]
    for row in rows:
        cpu = ", ".join(f"{value:.2f}" for value in row["cpu_ms_per_audio_s"])
        ratio = f"{row['ratio_median']:.3f}x ({min(row['ratio']):.3f}-{max(row['ratio']):.3f})"
        lines.append(f"| {row['entry']} | {cpu} | {ratio} | {row['failed_clients']} "
                     f"| {row['missing_or_extra_finals']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m qasr.bench.frontend_paired", description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("entries", nargs="+", help="PROTOCOL[:RATE[-ENCODING]][@CHUNK_MS]; the first is the base")
    p.add_argument("--streams", type=int, default=30, help="streams per protocol (default: %(default)s)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds each stream sends (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=None, help="default: one per protocol (each meets every server)")
    p.add_argument("--stagger-s", type=float, default=2.0, help="client starts spread over this long")
    p.add_argument("--python", default=sys.executable, help="the interpreter with qasr installed")
    p.add_argument("--bench-arg", dest="bench_args", action="append", default=[],
                   help="one more qasr-bench stream argument (repeat it), e.g. --bench-arg=--speed --bench-arg=2")
    args = p.parse_args(argv)
    entries = [Entry(text) for text in args.entries]
    if len({entry.text for entry in entries}) != len(entries) or args.streams < 1:
        p.error("give each protocol entry once, and --streams >= 1")
    args.outdir.mkdir(parents=True, exist_ok=True)
    servers = start_servers(len(entries), args.python, args.outdir)
    try:
        rounds = [run_round(entries, servers, r, args, args.outdir) for r in range(args.rounds or len(entries))]
    finally:
        for process, _, _ in servers:
            process.terminate()
            process.wait(timeout=30)
    text = markdown(table(entries, rounds), args.streams)
    (args.outdir / "paired.md").write_text(text + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
