"""Soak: N concurrent streams for M minutes against one server; what must not drift while it runs.

    python -m qasr.bench.soak --streams 50 --minutes 2                 # starts its own CPU server, tiny model
    python -m qasr.bench.soak --streams 600 --minutes 10 --url ws://gpu-host:8765/v1/stream --server-pid PID

Each stream sends speech-like utterances with pauses at real time (100 ms frames), ends after --stream-seconds,
checks what it got, and reconnects until the time is up (so connections churn too). A stream fails when it does
not close with 1000 after its summary, or when its finals are not exactly one per segment (every speech_started
id has one final, no id has two, and the summary counts as many). The server's resident memory, threads and open
file descriptors (its own and its engine process's, from /proc; or process_* from /metrics for a remote server)
and the event loop's asyncio tasks (qasr_event_loop_tasks from /metrics) are sampled every few seconds. It passes
(exit 0) when the issue's criteria hold (#14): 0 failed streams, exactly one final per segment, RSS growth < 5% from
the end of the warm-up to the end, and no more tasks or fds once idle after the run than idle before it. A benchmark
script, not a test: it prints and writes a JSON report (docs/reliability.md has the runs).

The streams are spread over --client-processes client processes (default: one per 100 streams, at most one per
core), each running its share (stream i in process i % N) and handing its tallies back to this one, which samples
the server and merges them into the one report and verdict: one Python event loop driving hundreds of streams and
their reconnections falls behind its own sends and keepalive pings, and its failures would be the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from qasr.audio import SAMPLE_RATE
from qasr.bench import proc_tree
from qasr.bench.synthetic import speech_like

FRAME_S = 0.1


@dataclass
class StreamResult:
    ok: bool
    segments: int = 0  # speech_started events
    finals: int = 0
    missing_finals: int = 0  # segments without a final
    duplicate_finals: int = 0  # finals beyond the first of a segment
    close_code: int | None = None
    problem: str = ""


@dataclass
class Sample:
    at_s: float
    rss_mb: float  # server (+ engine process) resident memory
    threads: int
    fds: int
    sessions_active: float | None = None
    tasks: float | None = None  # asyncio tasks in the server's event loop (qasr_event_loop_tasks)
    rss_mb_by_process: dict | None = None  # pid -> MB (a local server: which process grows)


@dataclass
class Report:
    streams: int
    minutes: float
    stream_seconds: float
    completed: int = 0
    failed: int = 0
    segments: int = 0
    finals: int = 0
    missing_finals: int = 0
    duplicate_finals: int = 0
    problems: dict = field(default_factory=dict)  # problem -> count
    first_failures: list = field(default_factory=list)  # [seconds into the run, stream index, problem], the first few
    client_processes: int = 1
    warmup_s: float = 30.0
    completed_per_process: list = field(default_factory=list)  # connections each client process made
    samples: list = field(default_factory=list)
    rss_growth_pct: float | None = None  # from the end of the warm-up to the end
    rss_mb_by_process: dict | None = None  # pid -> [MB at the end of the warm-up, MB at the end] (a local server)
    threads_growth: int | None = None
    # idle before the first stream -> idle after the last one closed (the server holds nothing of them any more)
    fds_growth: int | None = None
    tasks_growth: float | None = None
    sessions_active_after: float | None = None
    idle_after_series: list = field(default_factory=list)  # [s, fds, tasks, sessions] read every second after the run
    verdict: dict = field(default_factory=dict)  # each pass criterion of the issue -> whether it held


MAX_RSS_GROWTH_PCT = 5.0


def verdict(report: Report) -> dict:
    """The issue's pass criteria (#14): 0 failed streams, exactly one final per segment, RSS growth < 5% after the
    warm-up, no growth in tasks or file descriptors (idle after vs. idle before)."""
    return {"no_failed_streams": report.failed == 0,
            "one_final_per_segment": report.missing_finals == 0 and report.duplicate_finals == 0,
            "rss_growth_under_5pct": report.rss_growth_pct is not None and report.rss_growth_pct < MAX_RSS_GROWTH_PCT,
            "no_fd_growth": report.fds_growth is not None and report.fds_growth <= 0,
            "no_task_growth": report.tasks_growth is not None and report.tasks_growth <= 0}


def utterances(seconds: float, seed: int) -> np.ndarray:
    """Speech-like utterances of 1.5-4 s with 0.8-1.5 s pauses (a quiet noise floor), `seconds` long."""
    rng = np.random.default_rng(seed)
    pieces, total = [], 0
    while total < seconds * SAMPLE_RATE:
        speech = speech_like(rng.uniform(1.5, 4.0), seed=int(rng.integers(1 << 30)))
        pause = (0.002 * rng.standard_normal(int(rng.uniform(0.8, 1.5) * SAMPLE_RATE))).astype(np.float32)
        pieces += [speech, pause]
        total += len(speech) + len(pause)
    audio = np.concatenate(pieces)[:int(seconds * SAMPLE_RATE)]
    return (np.clip(audio, -1, 1) * 32767).astype("<i2")


AUDIO_POOL = 32  # different utterance sets per client process; a stream's rounds cycle through them


@functools.lru_cache(maxsize=AUDIO_POOL)
def pooled_utterances(seconds: float, seed: int) -> np.ndarray:
    return utterances(seconds, seed)


def stream_audio(seconds: float, index: int, round_: int) -> np.ndarray:
    """A connection's audio: one of AUDIO_POOL sets, made once per process. Synthesising 30 s of utterances takes
    ~25 ms of the client's event loop; made anew for every reconnection of hundreds of streams, it was a share of
    the lag that starved the client's own sends, reads and handshakes."""
    return pooled_utterances(seconds, (index * 7 + round_) % AUDIO_POOL)


async def one_stream(url: str, audio: np.ndarray, *, partials: bool = True, final_timeout_s: float = 120.0
                     ) -> StreamResult:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    started, finals, summary = set(), {}, None
    try:
        async with connect(url, open_timeout=30, max_size=None) as websocket:
            await websocket.send(json.dumps({"type": "start", "sample_rate": SAMPLE_RATE, "partials": partials}))

            async def read():
                nonlocal summary
                with contextlib.suppress(ConnectionClosed):
                    async for message in websocket:
                        event = json.loads(message)
                        if event["type"] == "speech_started":
                            started.add(event["segment_id"])
                        elif event["type"] == "final":
                            finals[event["segment_id"]] = finals.get(event["segment_id"], 0) + 1
                        elif event["type"] == "summary":
                            summary = event

            reading = asyncio.ensure_future(read())
            frame = int(FRAME_S * SAMPLE_RATE)
            loop = asyncio.get_running_loop()
            begin = loop.time()
            for index, offset in enumerate(range(0, len(audio), frame)):  # real time, without drift
                await websocket.send(audio[offset:offset + frame].tobytes())
                await asyncio.sleep(max(0.0, begin + (index + 1) * FRAME_S - loop.time()))
            await websocket.send('{"type": "end"}')
            await asyncio.wait_for(reading, final_timeout_s)  # the finals still due, the summary, the close
            code = websocket.close_code
    except Exception as error:  # noqa: BLE001 - every failure is counted by its kind
        return StreamResult(False, len(started), sum(finals.values()), problem=problem_of(error))
    result = StreamResult(True, len(started), sum(finals.values()), close_code=code,
                          missing_finals=len(started - finals.keys()),
                          duplicate_finals=sum(count - 1 for count in finals.values()))
    if code != 1000:
        result.ok, result.problem = False, f"close {code}"
    elif summary is None:
        result.ok, result.problem = False, "no summary"
    elif result.missing_finals or result.duplicate_finals or summary["segments"] != len(finals):
        result.ok, result.problem = False, "finals != segments"
    return result


def problem_of(error: Exception) -> str:
    """A failure's kind; a refused handshake with its HTTP status (503: loading, draining or admission control)."""
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if status is not None:
        return f"{type(error).__name__} {status}"
    cause = error.__cause__ or error.__context__  # InvalidMessage: why the answer was not HTTP (EOFError: none came)
    return f"{type(error).__name__} ({type(cause).__name__})" if cause is not None else type(error).__name__


def proc_usage(pid: int) -> tuple[float, int, int, dict[str, float]]:
    """(RSS MB, threads, fds, RSS MB per pid) of `pid` and its descendants (workers, engine processes), from /proc."""
    rss, threads, fds, by_process = 0.0, 0, 0, {}
    for process in [pid, *proc_tree.descendants(pid)]:
        with contextlib.suppress(OSError, AttributeError):
            status = Path(f"/proc/{process}/status").read_text()
            mb = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
            count = int(re.search(r"Threads:\s+(\d+)", status).group(1))
            open_fds = len(os.listdir(f"/proc/{process}/fd"))
            rss, threads, fds, by_process[str(process)] = rss + mb, threads + count, fds + open_fds, round(mb, 1)
    return rss, threads, fds, by_process


def scrape(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    return values


async def take_sample(metrics_url: str, pid: int | None, begin: float) -> Sample:
    by_process = None
    if pid is not None:  # before the scrape: its own connection is not among the fds
        rss, threads, fds, by_process = proc_usage(pid)
    metrics = {}
    with contextlib.suppress(OSError, ValueError):
        metrics = await asyncio.to_thread(scrape, metrics_url)
    if pid is None:
        rss = metrics.get("process_resident_memory_bytes", 0.0) / 2**20
        threads, fds = 0, int(metrics.get("process_open_fds", 0))
    return Sample(round(time.monotonic() - begin, 1), round(rss, 1), threads, fds, metrics.get("qasr_sessions_active"),
                  metrics.get("qasr_event_loop_tasks"), by_process)


async def settle(metrics_url: str, pid: int | None, begin: float, before: Sample, wait_s: float
                 ) -> tuple[Sample, list]:
    """The idle server after the run: read every second until its fds and tasks are back to `before`, for at most
    `wait_s` (connections the server is still closing, within websockets' close timeout, are not growth; a leak is
    there at every read). -> (the read with the fewest, [[s, fds, tasks, sessions], ...] of every read)."""
    reads = []
    deadline = time.monotonic() + wait_s
    while True:
        await asyncio.sleep(1.0)
        reads.append(await take_sample(metrics_url, pid, begin))
        last = reads[-1]
        back = last.fds <= before.fds and (last.tasks is None or before.tasks is None or last.tasks <= before.tasks)
        if back or time.monotonic() >= deadline:
            break
    series = [[read.at_s, read.fds, read.tasks, read.sessions_active] for read in reads]
    return min(reads, key=lambda read: (read.fds, read.tasks if read.tasks is not None else 0)), series


async def idle_sample(metrics_url: str, pid: int | None, begin: float, reads: int = 3, gap_s: float = 1.0) -> Sample:
    """The idle server: the read with the fewest fds and tasks of a few, a second apart (a socket the kernel is still
    closing, or the previous scrape's, is not growth; a leak is there in every read)."""
    samples = []
    for index in range(reads):
        if index:
            await asyncio.sleep(gap_s)
        samples.append(await take_sample(metrics_url, pid, begin))
    return min(samples, key=lambda sample: (sample.fds, sample.tasks if sample.tasks is not None else 0))


async def monitor(report: Report, metrics_url: str, pid: int | None, begin: float, stop: asyncio.Event,
                  period_s: float) -> None:
    while True:
        report.samples.append(await take_sample(metrics_url, pid, begin))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)
            return


async def soak(args, url: str, pid: int | None) -> Report:
    report = Report(args.streams, args.minutes, args.stream_seconds, client_processes=args.client_processes,
                    warmup_s=args.warmup_s)
    metrics_url = re.sub(r"^ws", "http", url.split("/v1/")[0]) + "/metrics"
    # one short stream first: what the server opens once, lazily (its first connection's, its first decode's), is
    # then in the idle baseline and not counted as growth
    await one_stream(url, utterances(3.0, seed=10**9), partials=not args.no_partials,
                     final_timeout_s=args.final_timeout_s)
    await asyncio.sleep(args.sample_s)
    begin = time.monotonic()
    idle_before = await idle_sample(metrics_url, pid, begin)
    deadline = begin + args.minutes * 60
    stop = asyncio.Event()
    watching = asyncio.ensure_future(monitor(report, metrics_url, pid, begin, stop, args.sample_s))

    if args.client_processes > 1:
        await client_processes(args, url, begin, deadline, report)
    else:
        await run_streams(args, url, range(args.streams), begin, deadline, report)
    for _ in range(60):  # the server tears the last connections down
        await asyncio.sleep(1)
        if report.samples and not report.samples[-1].sessions_active:
            break
    stop.set()
    await watching
    idle_after, report.idle_after_series = await settle(metrics_url, pid, begin, idle_before, args.idle_wait_s)
    report.samples = [idle_before, *report.samples, idle_after]
    warm = [sample for sample in report.samples if sample.at_s >= report.warmup_s]
    if len(warm) >= 2:
        first, last = warm[0], warm[-1]
        report.rss_growth_pct = round(100 * (last.rss_mb - first.rss_mb) / max(first.rss_mb, 1e-9), 2)
        report.threads_growth = last.threads - first.threads
        if first.rss_mb_by_process and last.rss_mb_by_process:
            report.rss_mb_by_process = {process: [first.rss_mb_by_process.get(process), mb]
                                        for process, mb in last.rss_mb_by_process.items()}
    report.fds_growth = idle_after.fds - idle_before.fds
    if idle_before.tasks is not None and idle_after.tasks is not None:
        report.tasks_growth = idle_after.tasks - idle_before.tasks
    report.sessions_active_after = idle_after.sessions_active
    report.verdict = verdict(report)
    return report


MAX_FIRST_FAILURES = 50
# rows per decode step: the CPU default (8) left throughput unused once streams queue (the tiny model's output layer
# costs 1.43 ms a token for 8 rows, 0.63 for 32); at 200 streams on 2 cores, 8 fell behind and 32 kept up
CPU_SLOTS = 32
RANDOM_MODEL_TOKENS_PER_S = 3.7  # the local tiny random model's decode budget per second of audio (bench/h200_*.sh)


async def run_streams(args, url: str, indices, begin: float, deadline: float, report: Report) -> None:
    """The streams `indices` (of args.streams), each starting at its place in the ramp from `begin` (monotonic:
    the same clock in every process of the host) and reconnecting until `deadline`; their tallies go to `report`."""

    async def worker(index: int) -> None:
        await asyncio.sleep(max(0.0, begin + args.ramp_s * index / args.streams - time.monotonic()))  # no storm
        round_ = 0
        while time.monotonic() < deadline:
            audio = stream_audio(args.stream_seconds, index, round_)
            result = await one_stream(url, audio, partials=not args.no_partials,
                                      final_timeout_s=args.final_timeout_s)
            report.completed += 1
            report.segments += result.segments
            report.finals += result.finals
            report.missing_finals += result.missing_finals
            report.duplicate_finals += result.duplicate_finals
            if not result.ok:
                report.failed += 1
                report.problems[result.problem] = report.problems.get(result.problem, 0) + 1
                if len(report.first_failures) < MAX_FIRST_FAILURES:
                    report.first_failures.append([round(time.monotonic() - begin, 1), index, result.problem])
                await asyncio.sleep(1.0)  # a refused or broken stream does not retry in a tight loop
            round_ += 1

    await asyncio.gather(*(worker(index) for index in indices))


TALLIES = ("completed", "failed", "segments", "finals", "missing_finals", "duplicate_finals")


def merge_tallies(report: Report, part: dict) -> None:
    """Add one client process's tallies (its Report's counts, problems and first failures) to `report`."""
    for name in TALLIES:
        setattr(report, name, getattr(report, name) + part[name])
    for problem, count in part["problems"].items():
        report.problems[problem] = report.problems.get(problem, 0) + count
    report.first_failures = sorted(report.first_failures + part["first_failures"])[:MAX_FIRST_FAILURES]


async def client_processes(args, url: str, begin: float, deadline: float, report: Report) -> None:
    """--client-processes N: N child processes run the streams (stream i in process i % N) against `url` on the
    same ramp and deadline, and write their tallies to files this process merges into `report`."""
    n = args.client_processes
    with tempfile.TemporaryDirectory(prefix="qasr-soak-clients-") as tmp:
        procs = []
        for k in range(n):
            cmd = [sys.executable, "-m", "qasr.bench.soak", "--url", url, "--streams", str(args.streams),
                   "--stream-seconds", repr(args.stream_seconds), "--ramp-s", repr(args.ramp_s),
                   "--final-timeout-s", repr(args.final_timeout_s), *(["--no-partials"] if args.no_partials else []),
                   "--client", f"{k}/{n}", "--begin", repr(begin), "--deadline", repr(deadline),
                   "--out", f"{tmp}/tallies-{k}.json"]
            procs.append(await asyncio.create_subprocess_exec(*cmd))
        codes = await asyncio.gather(*(proc.wait() for proc in procs))
        if any(codes):
            raise RuntimeError(f"soak client processes exited with {codes}")
        for k in range(n):
            part = json.loads(Path(f"{tmp}/tallies-{k}.json").read_text())
            merge_tallies(report, part)
            report.completed_per_process.append(part["completed"])


def run_client(args) -> int:
    """One of --client-processes' children: its share of the streams; its tallies (a Report's) to --out."""
    k, n = (int(part) for part in args.client.split("/"))
    report = Report(args.streams, args.minutes, args.stream_seconds)
    asyncio.run(run_streams(args, args.url, range(k, args.streams, n), args.begin, args.deadline, report))
    Path(args.out).write_text(json.dumps({name: getattr(report, name)
                                          for name in (*TALLIES, "problems", "first_failures")}))
    return 0


def default_warmup_s(minutes: float) -> float:
    """A fifth of the run, at least 30 s and at most 120 s."""
    return max(30.0, min(120.0, 12.0 * minutes))


def default_client_processes(streams: int, cores: int | None = None) -> int:
    """One client process per 100 streams, at most one per core."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, min(math.ceil(streams / 100), cores))


@contextlib.contextmanager
def local_server(args):
    """A qasr-server on the CPU (a tiny random model unless --model): yields (url, pid). Admission control is off
    (a later --server-arg=--admission-target-ms=MS turns it on): the soak holds its load to see what drifts, and a
    CPU past the latency target would answer new streams 503, which counts as failed streams. It decodes CPU_SLOTS
    sequences at once, and the random model's decodes are as long as speech's (RANDOM_MODEL_TOKENS_PER_S);
    --server-arg=--slots=N, --server-arg=--base-tokens=N etc. override."""
    workdir = Path(tempfile.mkdtemp(prefix="qasr-soak-"))
    model = args.model
    try:
        decode_length = []
        if model is None:
            # random weights never emit EOS, so each request would decode its whole budget (24 + 12 per audio
            # second: ~57 tokens for a 2.75 s utterance, ~10 in speech); as long as a real model's instead (H200 runs too)
            decode_length = ["--base-tokens", "0", "--tokens-per-second", str(RANDOM_MODEL_TOKENS_PER_S)]
            model = str(workdir / "tiny")
            subprocess.run([sys.executable, "-m", "qasr.model.testmodel", model, "--size", "tiny"], check=True,
                           capture_output=True)
        log = open(workdir / "server.log", "w+")
        server = subprocess.Popen([sys.executable, "-m", "qasr.server.cli", "--model", model, "--port", "0",
                                   "--device", "cpu", "--max-sessions", str(args.streams + 8),
                                   # every soak client connects from 127.0.0.1: the per-address handshake limit
                                   # (64) would refuse reconnections with 429 whenever the CPU falls behind
                                   "--max-pending-per-address", str(args.streams + 8),
                                   "--admission-target-ms", "0", "--slots", str(CPU_SLOTS), *decode_length,
                                   *args.server_args],
                                  stderr=log, stdout=log)
        try:
            url = None
            for _ in range(600):
                log.seek(0)
                text = log.read()
                listening = re.search(r"listening on (ws://\S+)", text)
                if listening and "engine ready" in text:
                    url = listening.group(1)
                    break
                if server.poll() is not None:
                    raise RuntimeError(f"qasr-server exited:\n{text[-2000:]}")
                time.sleep(0.5)
            if url is None:
                raise RuntimeError("qasr-server did not get ready within 300 s")
            yield url, server.pid
        finally:
            server.terminate()
            server.wait(60)
            log.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qasr-soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=50, help="concurrent streams")
    parser.add_argument("--minutes", type=float, default=2.0, help="how long to keep them going")
    parser.add_argument("--stream-seconds", type=float, default=30.0, help="audio per connection before it ends "
                                                                            "and reconnects")
    parser.add_argument("--ramp-s", type=float, default=10.0, help="spread the streams' starts over this long")
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="RSS growth is measured from here to the end (default: a fifth of the run, 30-120 s: the "
                             "server's buffers and the allocator's pools fill during the first minute at 100 streams)")
    parser.add_argument("--idle-wait-s", type=float, default=30.0,
                        help="after the run, wait at most this long for the server's fds and tasks to return to "
                             "their idle count before the last sample")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between resource samples")
    parser.add_argument("--no-partials", action="store_true", help="ask for finals only (a CPU that cannot keep "
                                                                   "up with every stream's partials)")
    parser.add_argument("--final-timeout-s", type=float, default=120.0,
                        help="after `end`, how long a stream waits for its remaining finals before it counts as failed")
    parser.add_argument("--url", default=None, help="an existing server's stream URL (default: start a CPU server)")
    parser.add_argument("--server-pid", type=int, default=None, help="that server's pid, for /proc (same host)")
    parser.add_argument("--model", default=None, help="checkpoint for the local server (default: a tiny random one)")
    parser.add_argument("--server-arg", dest="server_args", action="append", default=[],
                        help="extra qasr-server argument for the local server (repeatable)")
    parser.add_argument("--client-processes", type=int, default=None,
                        help="spread the streams over this many client processes (default: one per 100 streams, "
                             "at most one per core); the server is sampled from this one")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    # internal: one of --client-processes' children (its share K of N, the run's monotonic start and end)
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--begin", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.streams < 1 or args.minutes <= 0 or args.stream_seconds <= 0:
        parser.error("--streams, --minutes and --stream-seconds must be positive")
    if args.client is not None:
        return run_client(args)
    if args.warmup_s is None:
        args.warmup_s = default_warmup_s(args.minutes)
    if args.client_processes is None:
        args.client_processes = default_client_processes(args.streams)
    if args.client_processes < 1:
        parser.error("--client-processes must be >= 1")
    with contextlib.ExitStack() as stack:
        url, pid = (args.url, args.server_pid) if args.url else stack.enter_context(local_server(args))
        report = asyncio.run(soak(args, url, pid))
    summary = {key: value for key, value in asdict(report).items() if key != "samples"}
    print(json.dumps(summary, indent=1))
    if report.samples:
        print("samples (s, RSS MB, threads, fds, sessions, tasks):",
              " ".join(f"{s.at_s:g}/{s.rss_mb:g}/{s.threads}/{s.fds}/{s.sessions_active}/{s.tasks}"
                       for s in report.samples[::max(1, len(report.samples) // 12)]))
    if args.out:
        Path(args.out).write_text(json.dumps(asdict(report), indent=1))
    return 0 if all(report.verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
