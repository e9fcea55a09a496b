"""`qasr-bench stream`: N live clients against a running server, and the latencies each of them sees.

    qasr-bench stream --url ws://127.0.0.1:8765 --clients 32 --duration 60 --server-pid $(pgrep -n qasr-server) \\
        --out stream.json --plot stream.png
    qasr-bench stream --protocol openai ...     # OpenAI Realtime transcription sessions on /v1/realtime
    qasr-bench stream --protocol deepgram ...   # Deepgram live streams on /v1/listen (24 kHz linear16)
    qasr-bench stream --protocol twilio ...     # Twilio calls on /v1/twilio (--tracks both: caller and agent)
    qasr-bench stream --sample-rate 8000 --encoding mulaw --chunk-ms 20 ...   # native, a Twilio call's audio
    qasr-bench stream --words ...               # native streams ask for word times (a server with --aligner)
    qasr-bench stream --words-fraction 0.5 ...  # half of them ask: final latency with and without words, apart
    qasr-bench stream --label "1 GPU" --out run.json ...                      # a run that belongs to a scaling line
    qasr-bench stream --plot scaling.png --from run-*.json                    # no run: the scaling curve of runs

Every client streams audio in real time (or --speed times faster) for --duration seconds in the --protocol's wire
format (qasr.bench.protocol_clients: native through qasr.client's StreamClient, OpenAI Realtime, Deepgram and Twilio
Media Streams on plain websockets; native at --sample-rate in --encoding, so that it can send the audio an adapter gets): a WAV file (--audio, each
client starting at its own offset, looped), or generated speech-like utterances with pauses (a seed per client).
Then it ends the stream and waits for its last finals.
Measured per segment and client, with "when speech happened" taken as the moment the audio would have been captured
live (start + stream time / speed):

- first partial latency: speech start (the segment's start plus the VAD pre-roll) to its first partial (delta);
- partial latency: the end of the audio a partial heard to its arrival (native and twilio: OpenAI deltas say no
  audio end); partial cadence: gaps between a segment's partials (OpenAI: deltas);
- final latency (endpoint ->): native, twilio: the final's `latency_ms`, from the endpoint decision to sending;
  openai: the item's `speech_stopped` to its `completed` arriving; deepgram: none (its wire says no endpoint time);
  also by the segment's length (0-2, 2-4, 4-6, 6-8, 8+ s: "by_segment_length"), where a final carries its start and
  end: a final decodes tokens in proportion to its audio, so this shows whether the tail is the long segments;
- end of speech to final: the segment's end to the final arriving (includes the VAD's end silence);
- send lag: how far each chunk's send finished behind its real-time schedule (backpressure or an overloaded client);
- finals per segment: each segment must get exactly one (missing and duplicate finals are counted);
- server CPU: from /proc/<pid>/stat and every descendant's (--server-pid, same machine: with --workers the supervisor,
  its workers and engine processes), else `process_cpu_seconds_total` plus the engine process's
  `qasr_engine_process_cpu_seconds` on /metrics; also per second of audio and per stream.

With --words-fraction F (--words: F = 1) the clients that ask for word times are spread evenly over the clients
(client i asks when floor((i + 1) F) > floor(i F)), and the final latencies are also given apart for the streams that
asked and those that did not ("by_words"): the aligner must not delay the finals of streams that did not ask.

Prints p50/p90/p95/p99/max per metric, writes JSON (--out) and a plot (--plot, needs matplotlib). Stops by itself:
--duration of streaming, then at most --drain-timeout-s of waiting for finals.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import dataclasses
import json
import math
import re
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from qasr.audio import SAMPLE_RATE
from qasr.bench import proc_tree
from qasr.bench.protocol_clients import (CLIENTS, DEEPGRAM_RATE, NATIVE_ENCODINGS, OPENAI_RATE, TWILIO_RATE,
                                         ClientRecord, endpoint)
from qasr.bench.synthetic import speech_like
from qasr.client import FileSource

PERCENTILES = (50, 90, 95, 99)
NATIVE_RATES = (8000, 16000, 24000)  # Hz the native client can send: telephony's, the model's, OpenAI's
METRICS = {  # JSON key -> table label; all in milliseconds
    "first_partial_latency_ms": "first partial (speech start ->)",
    "partial_latency_ms": "partial (heard audio end ->)",
    "partial_gap_ms": "partial cadence (gap)",
    "final_latency_ms": "final (endpoint ->)",
    "end_to_final_ms": "final (speech end ->, client)",
    "send_lag_ms": "send lag behind real time",
}


# ---- audio -------------------------------------------------------------------------------------------------------


def utterances_with_pauses(seconds: float, seed: int) -> np.ndarray:
    """float32 16 kHz: speech-like utterances of 1.5-6 s between pauses of 0.8-2 s (long enough to end segments)."""
    rng = np.random.default_rng(seed)
    pieces, total = [], 0
    target = int(seconds * SAMPLE_RATE)
    while total < target:
        pause = 0.003 * rng.standard_normal(int(rng.uniform(0.8, 2.0) * SAMPLE_RATE))
        speech = speech_like(float(rng.uniform(1.5, 6.0)), seed=int(rng.integers(1 << 31)))
        pieces += [pause.astype(np.float32), speech]
        total += len(pause) + len(speech)
    return np.concatenate(pieces)[:target]


def load_source(path: str) -> np.ndarray:
    """A WAV/FLAC file as float32 mono at 16 kHz (qasr.client's file reader, then soxr)."""
    import soxr

    source = FileSource(path, realtime=False)
    if source.sample_rate == SAMPLE_RATE:
        return source.samples
    return soxr.resample(source.samples, source.sample_rate, SAMPLE_RATE).astype(np.float32)


def client_audio(source: np.ndarray | None, seconds: float, index: int) -> np.ndarray:
    """`seconds` of audio for client `index`: the WAV from its own offset (looped), or generated with its own seed."""
    n = int(math.ceil(seconds * SAMPLE_RATE))
    if source is None:
        return utterances_with_pauses(seconds, seed=index)
    offset = (index * 7919 * SAMPLE_RATE // 1000) % len(source)  # ~8 s apart, so clients do not speak in unison
    repeats = -(-(offset + n) // len(source))
    return np.tile(source, repeats)[offset : offset + n]


# ---- server CPU --------------------------------------------------------------------------------------------------


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds so far of a local process and all its live descendants (a server's front-end workers
    and engine processes, however deep: qasr.bench.proc_tree). FileNotFoundError once `pid` is gone."""
    table = proc_tree.processes()
    if pid not in table:
        raise FileNotFoundError(f"/proc/{pid}/stat")
    return sum(table[process][1] for process in [pid, *proc_tree.descendants(pid, table)])


def metrics_cpu_seconds(metrics_url: str) -> float | None:
    """`process_cpu_seconds_total` from the server's /metrics, when it exposes one."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    match = re.search(r"^process_cpu_seconds_total\s+([0-9.eE+-]+)$", text, re.MULTILINE)
    engine = re.search(r"^qasr_engine_process_cpu_seconds\s+([0-9.eE+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) + (float(engine.group(1)) if engine else 0.0) if match else None


class CpuSampler:
    """Samples the server's CPU seconds; `series` holds (seconds since start, % of one core) per interval."""

    def __init__(self, pid: int | None, metrics_url: str):
        self.pid, self.metrics_url = pid, metrics_url
        self.source = None
        self.series: list[tuple[float, float]] = []
        self._first: tuple[float, float] | None = None
        self._last: tuple[float, float] | None = None

    def _read(self) -> float | None:
        if self.pid is not None:
            self.source = f"/proc/{self.pid}/stat and its descendants"
            return process_cpu_seconds(self.pid)
        value = metrics_cpu_seconds(self.metrics_url)
        self.source = "/metrics process_cpu_seconds_total" if value is not None else None
        return value

    async def sample(self, since: float) -> None:
        cpu = await asyncio.to_thread(self._read) if self.pid is None else self._read()
        if cpu is None:
            return
        now = time.perf_counter()
        if self._last is not None and now > self._last[0]:
            self.series.append((now - since, 100.0 * (cpu - self._last[1]) / (now - self._last[0])))
        self._first = self._first or (now, cpu)
        self._last = (now, cpu)

    def summary(self) -> dict | None:
        if self._first is None or self._last is None or self._last[0] <= self._first[0]:
            return None
        seconds = self._last[1] - self._first[1]
        wall = self._last[0] - self._first[0]
        percents = [p for _, p in self.series]
        return {"source": self.source, "cpu_seconds": seconds, "wall_seconds": wall,
                "mean_percent_of_one_core": 100.0 * seconds / wall,
                "max_percent_of_one_core": max(percents) if percents else None}


# ---- analysis ----------------------------------------------------------------------------------------------------

WORDS_METRICS = ("final_latency_ms", "end_to_final_ms")  # what "by_words" gives apart


def asks_for_words(index: int, fraction: float) -> bool:
    """Whether client `index` asks for word times when a `fraction` of the clients do: spread evenly (every other
    client at 0.5), so that the two groups start across the whole stagger and share the client processes alike;
    the first n clients hold floor(n x fraction) that ask."""
    if fraction >= 1:
        return True
    return math.floor((index + 1) * fraction + 1e-9) > math.floor(index * fraction + 1e-9)


def segment_key(event: dict) -> tuple:
    """A segment's identity: its id within its channel (a two-track call numbers each track's segments)."""
    return event.get("channel"), event.get("segment_id")


def client_metrics(record: ClientRecord) -> dict[str, list[float]]:
    """Per-client samples of every metric, in ms (a protocol that does not say what a metric needs adds none)."""
    out: dict[str, list[float]] = {key: [] for key in METRICS}
    out["send_lag_ms"] = list(record.send_lag_ms)
    partials: dict[tuple, list[float]] = {}
    for arrived, event in record.events:
        kind = event.get("type")
        if kind == "partial":
            partials.setdefault(segment_key(event), []).append(arrived)
            if event.get("end") is not None:
                out["partial_latency_ms"].append((arrived - record.spoken_at(event["end"])) * 1e3)
        elif kind == "final":
            if event.get("latency_ms") is not None:
                out["final_latency_ms"].append(float(event["latency_ms"]))
            if event.get("end") is not None:
                out["end_to_final_ms"].append((arrived - record.spoken_at(event["end"])) * 1e3)
    starts = {segment_key(event): event for _, event in record.events if event.get("type") == "speech_started"}
    for key, times in partials.items():
        if key in starts:
            speech_start = starts[key]["start"] + record.pre_roll_s  # the first voiced frame, near enough
            out["first_partial_latency_ms"].append((times[0] - record.spoken_at(speech_start)) * 1e3)
        out["partial_gap_ms"] += [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    return out


def finals_per_segment(record: ClientRecord) -> tuple[int, int]:
    """(segments that started and got no final, finals beyond the first of a segment or of none that started)."""
    started = {segment_key(event) for _, event in record.events if event.get("type") == "speech_started"}
    finals = collections.Counter(segment_key(event) for _, event in record.events if event.get("type") == "final")
    missing = sum(1 for key in started if finals[key] == 0)
    extra = sum(count - (1 if key in started else 0) for key, count in finals.items())
    return missing, extra


def distribution(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    array = np.asarray(values, dtype=np.float64)
    stats = {"n": int(array.size), "mean": float(array.mean())}
    stats.update({f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES})
    stats["max"] = float(array.max())
    return stats


def analyse(records: list[ClientRecord], words_fraction: float = 0.0) -> tuple[dict, list[dict]]:
    pooled: dict[str, list[float]] = {key: [] for key in METRICS}
    sessions = []
    for record in records:
        metrics = client_metrics(record)
        for key, values in metrics.items():
            pooled[key] += values
        asked = words_fraction > 0 and asks_for_words(record.index, words_fraction)
        kinds = [event.get("type") for _, event in record.events]
        missing, extra = finals_per_segment(record)
        sessions.append({
            "client": record.index, "session_id": record.session_id, "words": asked, "close_code": record.close_code,
            "error": record.error, "drained": record.drained, "audio_seconds": record.audio_seconds,
            "segments": kinds.count("speech_started"), "partials": kinds.count("partial"),
            "finals": kinds.count("final"), "errors": kinds.count("error"),
            "finals_with_words": sum(1 for _, event in record.events if event.get("type") == "final"
                                     and event.get("words")),
            "missing_finals": missing, "extra_finals": extra,
            "metrics": {key: distribution(values) for key, values in metrics.items()},
        })
    return {key: distribution(values) for key, values in pooled.items()}, sessions


def by_words(records: list[ClientRecord], sessions: list[dict]) -> dict:
    """The finals' latencies of the streams that asked for word times and of those that did not, apart, with how many
    clients each group had."""
    groups = {"with_words": [], "without_words": []}
    for record, session in zip(records, sessions):
        groups["with_words" if session["words"] else "without_words"].append(record)
    out = {}
    for name, members in groups.items():
        samples = {key: [] for key in WORDS_METRICS}
        for record in members:
            metrics = client_metrics(record)
            for key in WORDS_METRICS:
                samples[key] += metrics[key]
        out[name] = {"clients": len(members), **{key: distribution(values) for key, values in samples.items()}}
    return out


SEGMENT_LENGTH_BINS_S = (0.0, 2.0, 4.0, 6.0, 8.0)  # lower edges; the last bin is open


def by_segment_length(records: list[ClientRecord]) -> list[dict]:
    """The finals' latencies (endpoint ->) by their segment's length, one entry per bin with finals: a final decodes
    tokens in proportion to its audio, so this says how much of the tail is long segments (a protocol whose finals
    carry no start, end or latency adds none)."""
    edges = SEGMENT_LENGTH_BINS_S
    samples: list[list[float]] = [[] for _ in edges]
    for record in records:
        for _, event in record.events:
            if event.get("type") != "final" or None in (event.get("start"), event.get("end"), event.get("latency_ms")):
                continue
            length = float(event["end"]) - float(event["start"])
            samples[max(0, bisect.bisect_right(edges, length) - 1)].append(float(event["latency_ms"]))
    return [{"from_s": edge, "to_s": edges[i + 1] if i + 1 < len(edges) else None, **distribution(values)}
            for i, (edge, values) in enumerate(zip(edges, samples)) if values]


def cpu_costs(cpu: dict | None, audio_seconds: float, clients: int) -> dict | None:
    """The server's CPU with what it costs per second of audio (ms) and per stream (% of one core)."""
    if cpu is None:
        return None
    return {**cpu, "cpu_ms_per_audio_second": 1e3 * cpu["cpu_seconds"] / audio_seconds if audio_seconds else None,
            "percent_of_one_core_per_stream": cpu["mean_percent_of_one_core"] / clients}


def print_table(summary: dict, out: dict) -> None:
    config, totals = out["config"], out["totals"]
    interval = (f"partials every {config['partial_interval_ms']} ms" if config["protocol"] == "native"
                else "partials at the server's default interval")
    print(f"# {config['protocol']} ({config['audio_format']}): {config['clients']} clients x {config['duration_s']:g} s at {config['speed']:g}x "
          f"real time, {interval}, audio: {config['audio']}")
    words = f", {totals['finals_with_words']} with words" if config["words"] else ""
    print(f"# {totals['segments']} segments, {totals['finals']} finals ({totals['missing_finals']} missing, "
          f"{totals['extra_finals']} extra{words}), {totals['partials']} partials, {totals['audio_seconds']:.0f} s of audio "
          f"sent, {totals['failed_clients']} clients failed")
    header = f"{'metric (ms)':<32} {'n':>6} " + " ".join(f"{f'p{p}':>8}" for p in PERCENTILES) + f" {'max':>8}"
    print(header)
    print("-" * len(header))
    for key, label in METRICS.items():
        stats = summary[key]
        if not stats["n"]:
            print(f"{label:<32} {0:>6} " + " ".join(f"{'-':>8}" for _ in PERCENTILES) + f" {'-':>8}")
            continue
        print(f"{label:<32} {stats['n']:>6} " + " ".join(f"{stats[f'p{p}']:8.1f}" for p in PERCENTILES)
              + f" {stats['max']:8.1f}")
    for group, label in (("with_words", "streams with words"), ("without_words", "streams without words")):
        stats = out.get("by_words", {}).get(group, {}).get("final_latency_ms")
        if stats is None:
            continue
        clients = out["by_words"][group]["clients"]
        line = f"{'final (endpoint ->), ' + label:<44} {clients:>4} clients {stats['n']:>6} finals"
        print(line + ("" if not stats["n"] else " " + " ".join(f"p{p} {stats[f'p{p}']:.1f}" for p in (50, 95, 99))))
    for row in out.get("by_segment_length", []):
        span = f"{row['from_s']:g}-{row['to_s']:g} s" if row["to_s"] is not None else f">= {row['from_s']:g} s"
        print(f"{'final (endpoint ->), segments ' + span:<44} {row['n']:>6} finals "
              + " ".join(f"p{p} {row[f'p{p}']:.1f}" for p in (50, 95, 99)))
    cpu = out["server_cpu"]
    if cpu:
        print(f"server CPU: {cpu['mean_percent_of_one_core']:.0f}% of one core on average"
              + (f", {cpu['max_percent_of_one_core']:.0f}% at most" if cpu["max_percent_of_one_core"] is not None
                 else "") + f" ({cpu['cpu_seconds']:.1f} CPU s over {cpu['wall_seconds']:.1f} s; {cpu['source']})")
        if cpu.get("cpu_ms_per_audio_second") is not None:
            print(f"server CPU per second of audio: {cpu['cpu_ms_per_audio_second']:.1f} ms; per stream: "
                  f"{cpu['percent_of_one_core_per_stream']:.2f}% of one core")
    else:
        print("server CPU: not measured (give --server-pid for a local server)")


def plot(path: str, records: list[ClientRecord], summary_series: dict, out: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    pooled = {key: [] for key in METRICS}
    for record in records:
        for key, values in client_metrics(record).items():
            pooled[key] += values
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    for key in ("first_partial_latency_ms", "partial_latency_ms", "final_latency_ms", "end_to_final_ms"):
        values = np.sort(pooled[key])
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / values.size, label=METRICS[key])
    ax.set(xlabel="ms", ylabel="fraction", title="latency CDFs")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    if pooled["partial_gap_ms"]:
        ax.hist(pooled["partial_gap_ms"], bins=40)
    ax.set(xlabel="ms", ylabel="count", title="gaps between partials of a segment")
    ax = axes[1][0]
    for record in records:
        if record.lag_series:
            xs, ys = zip(*record.lag_series)
            ax.plot(xs, ys, linewidth=0.6)
    ax.set(xlabel="s since start", ylabel="ms", title="send lag behind real time, per client")
    ax = axes[1][1]
    if summary_series["cpu"]:
        xs, ys = zip(*summary_series["cpu"])
        ax.plot(xs, ys)
    ax.set(xlabel="s since start", ylabel="% of one core", title="server CPU")
    config = out["config"]
    fig.suptitle(f"qasr stream bench: {config['clients']} clients, {config['speed']:g}x real time, "
                 f"{config['duration_s']:g} s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the run -----------------------------------------------------------------------------------------------------


def audio_format(args) -> str:
    """What the clients' audio is on the wire: "16000 Hz s16le", "8000 Hz mulaw"."""
    rate, encoding = {"native": (args.sample_rate, args.encoding), "openai": (OPENAI_RATE, "s16le"),
                      "deepgram": (DEEPGRAM_RATE, "s16le"),
                      "twilio": (TWILIO_RATE, "mulaw")}[args.protocol]
    return f"{rate} Hz {encoding}"


def num_tracks(args) -> int:
    return 2 if args.protocol == "twilio" and args.tracks == "both" else 1


async def run_clients(args, indices: list[int], bench_start: float, stop_at: float) -> list[ClientRecord]:
    """Run the clients `indices` (of args.clients), each starting at its place in the stagger."""
    source = load_source(args.audio) if args.audio else None
    records = [ClientRecord(i, speed=args.speed) for i in indices]
    run_client = CLIENTS[args.protocol]

    def client_args(index: int):  # the native client reads `words`: whether this one asks (--words-fraction)
        if args.words_fraction <= 0:
            return args
        return argparse.Namespace(**{**vars(args), "words": asks_for_words(index, args.words_fraction)})

    async def staggered(record: ClientRecord) -> None:
        # a second track (a call's agent) is another client's audio: different speech, its own pauses
        tracks = [client_audio(source, args.duration * args.speed, record.index + k * args.clients)
                  for k in range(num_tracks(args))]
        due = bench_start + args.stagger_s * record.index / max(1, args.clients)
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        # a client that starts late (a --processes child still importing) still streams its whole --duration
        await run_client(client_args(record.index), record, tracks, max(stop_at, time.perf_counter() + args.duration),
                         bench_start)

    await asyncio.gather(*(staggered(r) for r in records))
    return records


async def run_workers(args, bench_start: float, stop_at: float, tmp: str) -> asyncio.Future:
    """--processes K: K child processes share the clients (client i in process i % K), so that one Python event
    loop on the client side is not what limits a large run. perf_counter is the system's monotonic clock, so the
    children's times compare with ours. -> a future of all their records."""
    procs = []
    for k in range(args.processes):
        cmd = [sys.executable, "-m", "qasr.bench.stream", *args.argv, "--processes", "1", "--no-progress",
               "--worker", f"{k}/{args.processes}", "--bench-start", repr(bench_start),
               "--records-out", f"{tmp}/records-{k}.json"]
        procs.append(await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.DEVNULL))

    async def collect() -> list[ClientRecord]:
        codes = await asyncio.gather(*(p.wait() for p in procs))
        if any(codes):
            raise RuntimeError(f"client processes exited with {codes}")
        records = []
        for k in range(args.processes):
            for raw in json.loads(Path(f"{tmp}/records-{k}.json").read_text()):
                raw["events"] = [tuple(e) for e in raw["events"]]
                raw["lag_series"] = [tuple(x) for x in raw["lag_series"]]
                records.append(ClientRecord(**raw))
        return sorted(records, key=lambda r: r.index)

    return asyncio.ensure_future(collect())


async def bench(args) -> dict:
    import tempfile

    from tqdm import tqdm

    bench_start = args.bench_start or time.perf_counter()
    stop_at = bench_start + args.stagger_s + args.duration
    if args.worker:  # one of --processes children: run our share, hand the records to the parent
        k, n = (int(x) for x in args.worker.split("/"))
        records = await run_clients(args, list(range(k, args.clients, n)), bench_start, stop_at)
        Path(args.records_out).write_text(json.dumps([dataclasses.asdict(r) for r in records]))
        return {}
    parts = urlsplit(args.url)
    metrics_url = f"{'https' if parts.scheme == 'wss' else 'http'}://{parts.netloc}/metrics"
    cpu = CpuSampler(args.server_pid, metrics_url)
    await cpu.sample(bench_start)
    tmp = tempfile.TemporaryDirectory()
    if args.processes > 1:
        clients = await run_workers(args, bench_start, stop_at, tmp.name)
        records: list[ClientRecord] = []
    else:
        records = [ClientRecord(i) for i in range(args.clients)]
        clients = asyncio.ensure_future(run_clients(args, list(range(args.clients)), bench_start, stop_at))
    limit = args.stagger_s + args.duration + args.drain_timeout_s
    with tqdm(total=round(limit), unit="s", desc="streaming", disable=not args.progress, file=sys.stderr) as bar:
        while not clients.done():
            await asyncio.wait({clients}, timeout=args.sample_interval_s)
            await cpu.sample(bench_start)
            elapsed = time.perf_counter() - bench_start
            bar.set_description("streaming" if elapsed < args.stagger_s + args.duration else "draining")
            bar.update(max(0, min(round(elapsed), bar.total) - bar.n))
    records = await clients
    tmp.cleanup()
    summary, sessions = analyse(records, args.words_fraction)
    totals = {key: sum(session[key] for session in sessions)
              for key in ("segments", "partials", "finals", "finals_with_words", "errors", "missing_finals",
                          "extra_finals", "audio_seconds")}
    totals["failed_clients"] = sum(1 for session in sessions if session["error"] or not session["drained"])
    out = {
        "config": {"protocol": args.protocol, "url": endpoint(args.url, args.protocol), "clients": args.clients,
                   "tracks": num_tracks(args), "duration_s": args.duration, "speed": args.speed,
                   "chunk_ms": args.chunk_ms, "audio_format": audio_format(args), "partial_interval_ms": args.partial_interval_ms,
                   "language": args.language, "words": args.words_fraction > 0,
                   "words_fraction": args.words_fraction, "label": args.label,
                   "audio": args.audio or "generated utterances with pauses", "stagger_s": args.stagger_s, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
        "wall_seconds": time.perf_counter() - bench_start,
        "totals": totals,
        "summary": summary,
        **({"by_words": by_words(records, sessions)} if args.words_fraction > 0 else {}),
        "by_segment_length": by_segment_length(records),
        "server_cpu": cpu_costs(cpu.summary(), totals["audio_seconds"], args.clients),
        "server_cpu_series": cpu.series,
        "sessions": sessions,
    }
    print_table(summary, out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    if args.plot:
        plot(args.plot, records, {"cpu": cpu.series}, out)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qasr-bench stream", description=__doc__.split("\n\n")[0].replace("`", ""))
    p.add_argument("--protocol", choices=sorted(CLIENTS), default="native",
                   help="the clients' wire format: native (/v1/stream), openai (Realtime transcription on "
                        "/v1/realtime), deepgram (live streams on /v1/listen), twilio (Media Streams calls on "
                        "/v1/twilio, transcripts from /v1/calls/{callSid}/events) (default: %(default)s)")
    p.add_argument("--tracks", choices=("inbound", "both"), default="inbound",
                   help="twilio: the caller's track alone, or the agent's too (different speech) "
                        "(default: %(default)s)")
    p.add_argument("--url", default="ws://127.0.0.1:8765",
                   help="the server; without a path, the --protocol's path is added (default: %(default)s)")
    p.add_argument("--clients", type=int, default=8, help="concurrent streams (default: %(default)s)")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds each client streams, wall time (default: %(default)s)")
    p.add_argument("--speed", type=float, default=1.0,
                   help="audio seconds sent per second; 1 is real time (default: %(default)s)")
    p.add_argument("--audio", help="a WAV/FLAC file to stream (looped; each client from its own offset); "
                                   "default: generated speech-like utterances with pauses")
    p.add_argument("--chunk-ms", type=int, default=100,
                   help="audio per message; twilio always sends 20 ms frames and sends those due every --chunk-ms "
                        "together (default: %(default)s)")
    p.add_argument("--sample-rate", type=int, choices=NATIVE_RATES, default=SAMPLE_RATE,
                   help="native: the rate of the audio sent; 24000 is what --protocol openai sends, 8000 (with "
                        "--encoding mulaw) what twilio sends, so the adapters compare with native on the same audio "
                        "(default: %(default)s)")
    p.add_argument("--encoding", choices=sorted(NATIVE_ENCODINGS), default="s16le",
                   help="native: the audio's encoding on the wire (default: %(default)s)")
    p.add_argument("--partial-interval-ms", type=int, default=1000,
                   help="native: asked of the server in `start` (openai and twilio cannot ask: the server's "
                        "default applies) (default: %(default)s)")
    p.add_argument("--language", default=None,
                   help="force a language: a name or code (openai sends it as given, e.g. en; twilio as the "
                        "qasr_language custom parameter) "
                        "(default: the model detects it)")
    words = p.add_mutually_exclusive_group()
    words.add_argument("--words", action="store_true",
                       help="native: every stream asks for word times on its finals (the server needs --aligner; "
                            "finals_with_words counts those that carried some); the same as --words-fraction 1")
    words.add_argument("--words-fraction", type=float, default=0.0, metavar="F",
                       help="native: this fraction of the streams (spread evenly over the clients) ask for word "
                            "times; final latency is also reported apart for the streams with and without words "
                            "(default: %(default)s)")
    p.add_argument("--stagger-s", type=float, default=1.0,
                   help="client starts are spread over this long (default: %(default)s)")
    p.add_argument("--drain-timeout-s", type=float, default=60.0,
                   help="after streaming, wait this long for finals (default: %(default)s)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="a local server's pid: its CPU is read from /proc (default: from the server's /metrics)")
    p.add_argument("--sample-interval-s", type=float, default=0.5,
                   help="CPU sampling and progress interval (default: %(default)s)")
    p.add_argument("--out", metavar="JSON", help="also write the results here")
    p.add_argument("--plot", metavar="PNG", help="also write a plot here (needs matplotlib); with --from, the scaling "
                   "curve of earlier runs instead of a run")
    p.add_argument("--from", dest="from_runs", nargs="+", metavar="JSON",
                   help="no run: plot earlier --out results as a scaling curve (final latency p50/p95/p99 and refused "
                   "streams against clients, one line per --label) into --plot")
    p.add_argument("--label", help="the line this run belongs to on a scaling curve, e.g. \"1 GPU\" (kept in --out)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="hide the progress bar (shown on stderr by default)")
    p.add_argument("--processes", type=int, default=1,
                   help="spread the clients over this many client processes, for hundreds of clients "
                        "(default: %(default)s)")
    # internal: a --processes child
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--bench-start", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--records-out", help=argparse.SUPPRESS)
    return p


def plot_runs(parser: argparse.ArgumentParser, args) -> dict:
    """`--from`: the scaling curve of earlier runs, and its points as a table."""
    from qasr.bench.scaling import load_runs, plot_scaling

    if not args.plot:
        parser.error("--from needs --plot PNG (where to draw the scaling curve)")
    lines = plot_scaling(args.plot, load_runs(args.from_runs))
    print(f"{'line':<16} {'clients':>8} {'p50':>8} {'p95':>8} {'p99':>8} {'refused':>8} {'finals':>12}")
    for label, points in lines.items():
        for pt in points:
            ms = [f"{pt['latency'][p]:8.0f}" if pt["latency"] else f"{'-':>8}" for p in ("p50", "p95", "p99")]
            print(f"{label:<16} {pt['clients']:>8} {' '.join(ms)} {pt['refused']:>8} "
                  f"{pt['finals']:>5}/{pt['segments']:<6}")
    print(f"wrote {args.plot}")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.from_runs:
        return plot_runs(parser, args)
    if args.clients < 1 or args.duration <= 0 or args.speed <= 0 or args.chunk_ms < 10 or args.processes < 1:
        parser.error("need --clients >= 1, --duration > 0, --speed > 0, --chunk-ms >= 10 and --processes >= 1")
    if args.tracks != "inbound" and args.protocol != "twilio":
        parser.error(f"--tracks {args.tracks} is for --protocol twilio")
    if args.words:
        args.words_fraction = 1.0
    if not 0 <= args.words_fraction <= 1:
        parser.error("--words-fraction must be between 0 and 1")
    if args.words_fraction > 0 and args.protocol != "native":
        parser.error("--words and --words-fraction are for --protocol native (the others cannot ask for word times)")
    if (args.sample_rate, args.encoding) != (SAMPLE_RATE, "s16le") and args.protocol != "native":
        parser.error("--sample-rate and --encoding are for --protocol native (the others send their own format)")
    try:
        endpoint(args.url, args.protocol)
    except ValueError as error:
        parser.error(f"--url: {error}")
    args.argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}/stat").exists():
        parser.error(f"--server-pid {args.server_pid}: no such local process (/proc/{args.server_pid}/stat)")
    try:
        import uvloop
    except ImportError:
        return asyncio.run(bench(args))
    return uvloop.run(bench(args))


if __name__ == "__main__":
    main()
