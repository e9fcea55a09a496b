"""qasr-server: serve a Qwen3-ASR model to streaming clients over WebSockets.

    qasr-server --model Qwen/Qwen3-ASR-0.6B --host 0.0.0.0 --port 8765

The port answers HTTP at once (/healthz; /readyz says 503 until the model is loaded and has served a warm-up
decode); streams are admitted once the engine is ready (before that their upgrades get HTTP 503). SIGTERM or
SIGINT: refuse new streams (503) while /healthz and /readyz still answer, send open streams their finals, close
them with 1001, stop the engine, exit 0. While the model is still loading, SIGTERM/SIGINT abandon the load and
exit 0 at once (an engine process still loading is terminated with the server).

Exit codes: 0 stopped by SIGTERM/SIGINT; 1 the port cannot be bound or the model cannot be loaded (or fails its
warm-up decode); 2 a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import logging
import os
import signal
import sys

from qasr.server.app import QasrServer, ServerConfig
from qasr.server import logs, security, telephony
from qasr.server.http import find_web_root
from qasr.server.limits import ServerLimits
from qasr.streaming.settings import StreamLimits, StreamSettings, VadSettings
from qasr.engine.options import MINIMUMS, EngineOptions, add_number_format_flags, number_formats
from qasr.engine.restart_budget import RestartBudget
from qasr.engine.pool import LoadPolicy
from qasr.server import engine_load
from qasr.server.admission import AdmissionSettings

log = logging.getLogger("qasr.server")

# The KV cache is sized up front (slots x max_len): on the CPU the real 0.6B model in fp32 takes ~29 MB per slot
# per 128 positions, so a GPU-sized default would reserve ~15 GB of host memory.
CPU_SLOTS = 8


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default where it says something: not for a required option, a flag, or a None whose
    meaning the help text gives."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    limits, defaults = ServerLimits(), StreamSettings()
    parser = argparse.ArgumentParser(prog="qasr-server", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True,
                        help="checkpoint directory (e.g. from qasr-make-test-model) or Hugging Face id "
                             "(e.g. Qwen/Qwen3-ASR-0.6B)")
    parser.add_argument("--aligner", default=None, metavar="DIR_OR_ID",
                        help="a Qwen3-ForcedAligner checkpoint (e.g. Qwen/Qwen3-ForcedAligner-0.6B), loaded beside the "
                             "model: streams that ask get word times on their finals (without it they are refused)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8765, help="port to listen on (0: any free port)")
    parser.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="auto: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--max-sessions", type=int, default=limits.max_sessions,
                        help="concurrent streams; more are closed with 1013")
    parser.add_argument("--max-message-bytes", type=int, default=limits.max_message_bytes,
                        help="largest client frame; larger ones close with 1009")
    parser.add_argument("--idle-timeout-s", type=float, default=limits.idle_timeout_s,
                        help="close a stream with 1008 after this long without a frame")
    parser.add_argument("--drain-timeout-s", type=float, default=limits.drain_timeout_s,
                        help="on shutdown, how long open streams may wait for their finals")
    parser.add_argument("--partial-interval-ms", type=int, default=defaults.partial_interval_ms,
                        help="default partial cadence (new speech between partials)")
    parser.add_argument("--vad-aggressiveness", type=int, default=defaults.vad.aggressiveness, choices=range(4),
                        help="default webrtcvad mode: 0 keeps most audio, 3 drops most non-speech")
    parser.add_argument("--end-silence-ms", type=int, default=defaults.vad.end_silence_ms,
                        help="default silence that ends a segment")
    parser.add_argument("--max-segment-s", type=float, default=defaults.vad.max_segment_s,
                        help="longest segment (default and limit); longer speech is cut at its quietest point")
    engine = EngineOptions()
    parser.add_argument("--slots", type=int, default=None,
                        help=f"sequences the engine decodes together (KV cache slots, the largest CUDA graph); "
                             f"default {engine.num_slots} on a GPU, {CPU_SLOTS} on the CPU")
    parser.add_argument("--max-len", type=int, default=engine.max_len,
                        help="prompt + generated tokens per sequence (a 30 s segment needs ~800)")
    parser.add_argument("--retained-slots", type=int, default=None,
                        help="extra KV slots keeping streams' audio prefixes so partials prefill only what is new; "
                             "default: as many as --slots")
    parser.add_argument("--base-tokens", type=int, default=engine.base_tokens,
                        help="decode budget per request: BASE + TOKENS_PER_SECOND x audio seconds (stops runaways)")
    parser.add_argument("--tokens-per-second", type=float, default=engine.tokens_per_second,
                        help="see --base-tokens")
    parser.add_argument("--admission-interval-ms", type=float, default=engine.admission_interval_ms,
                        help="while sequences decode, decode this long between two admissions of new requests "
                             "(batches arrivals into one encode + prefill; 0: admit between every decode step)")
    parser.add_argument("--rollback-tokens", type=int, default=engine.rollback_tokens,
                        help="a partial continues its segment's previous partial minus this many last tokens, "
                             "which it decodes again (0: every partial decodes from the audio alone)")
    parser.add_argument("--decode-steps-ahead", type=int, default=engine.decode_steps_ahead,
                        help="decode steps queued at once beside an admission's host work, at most (as many as fit "
                             "in the time it has been taking; 1: one step)")
    parser.add_argument("--decode-run-ahead", action="store_true",
                        help="queue the next decode step before reading the last, so the GPU does not wait while "
                             "the host handles its tokens (offline work does; live, it gave a worse final p95)")
    add_number_format_flags(parser, "tokens may differ from bf16's (docs/benchmarks.md has the speed and the "
                                    "agreement measured; FP8 products are for offline throughput)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="benchmarks only: decode every request's full budget (random-weight models)")
    parser.add_argument("--workers", type=int, default=1,
                        help="front-end processes (WebSockets, sessions, VAD) sharing the port (SO_REUSEPORT), each "
                             "feeding every engine process (one per device of --devices) over connections of its "
                             "own and placing its own streams (1: one server process)")
    parser.add_argument("--engine-in-process", action="store_true",
                        help="debugging: run the engine on a thread of the server process instead of a process of "
                             "its own (under load the two then contend for one interpreter). Its engine is never "
                             "restarted (a CUDA error poisons the whole process): if its thread dies, /healthz says "
                             "500, the segments it held get empty finals after a decode_failed error, and streams "
                             "that need it later close with 1011")
    budget = RestartBudget()  # the engine process's restarts (docs/reliability.md)
    parser.add_argument("--engine-max-restarts", type=int, default=None, metavar="N",
                        help=f"an engine process that dies (a CUDA error, out of memory, a kill) is restarted at most "
                             f"this many times in --engine-restart-window-s; past that /healthz says 500 (0: never "
                             f"restart). Default {budget.max_restarts}")
    parser.add_argument("--engine-restart-window-s", type=float, default=None, metavar="S",
                        help=f"see --engine-max-restarts. Default {budget.window_s:g}")
    # an engine per device, and admission control (qasr.engine.pool, qasr.server.admission)
    parser.add_argument("--devices", default=None, metavar="LIST",
                        help="one engine per device, each new stream on the least-loaded: GPU indices (0,1) or "
                             "device names (cuda:0,cuda:1; cpu,cpu runs two engines on the CPU). Default: every "
                             "visible GPU when --device is auto or cuda, else one engine on --device")
    parser.add_argument("--admission-target-ms", type=float, default=None,
                        help="admission control: the p90 latency of recent finals (submit to result: queue, "
                             "encode, prefill, decode, IPC) at which an engine has no headroom left; with none left "
                             "on any engine, new streams are refused (HTTP 503 or 1013 server_full, with a retry "
                             "hint) and, once 25%% past it, partials thin out (0: off). "
                             f"Default {LoadPolicy().target_ms:g} when the engines run on GPUs, off on the CPU "
                             "(development and tests: a CPU engine is past any latency target under load)")
    parser.add_argument("--web-root", default=None,
                        help="folder with the web page's index.html (default: $QASR_WEB_ROOT, then the web/ "
                             "folder beside the package)")
    parser.add_argument("--log-level", default="info", choices=logs.LEVELS,
                        help="least severe log records shown; debug adds a line per HTTP request")
    parser.add_argument("--log-format", default="text", choices=logs.FORMATS,
                        help="text lines for people, or one JSON object per line (time, level, logger, message, "
                             "session where known) for log pipelines")
    security.add_arguments(parser)  # --auth, --api-keys-file, --ssl-*, --allowed-origins, client limits
    telephony.add_arguments(parser)  # --webhook-url, --webhook-secret, --webhook-allow, --webhook-partials
    return parser


def build_config(args: argparse.Namespace, *, check_device: bool = True) -> ServerConfig:
    """The server's configuration from parsed arguments; ValueError/FileNotFoundError say what is wrong.
    check_device: False in a front-end worker (its supervisor checked it; a worker imports no torch)."""
    limits = ServerLimits(max_sessions=args.max_sessions, max_message_bytes=args.max_message_bytes,
                          idle_timeout_s=args.idle_timeout_s, drain_timeout_s=args.drain_timeout_s)
    # --max-segment-s is both the default and the limit; the stream settings validate the flags once
    stream_limits = StreamLimits(max_segment_s=args.max_segment_s, word_times=args.aligner is not None)
    defaults = StreamSettings(partial_interval_ms=args.partial_interval_ms,
                              vad=VadSettings(aggressiveness=args.vad_aggressiveness,
                                              end_silence_ms=args.end_silence_ms, max_segment_s=args.max_segment_s))
    if check_device:
        from qasr.model.checkpoint import resolve_device  # imports torch: only once the arguments are parsed

        resolve_device(args.device)  # an unusable --device is a usage error, before anything starts
        devices = engine_load.engine_devices(args.device, args.devices)  # and so is an unusable --devices
        if args.admission_target_ms is None:
            args.admission_target_ms = default_admission_target_ms(devices, resolve_device(args.device))
    elif args.admission_target_ms is None:  # a worker is given the supervisor's resolved value; else the GPU default
        args.admission_target_ms = LoadPolicy().target_ms
    if args.admission_target_ms < 0:
        raise ValueError(f"--admission-target-ms must be >= 0 (0: off), got {args.admission_target_ms:g}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    if args.workers > 1 and args.engine_in_process:
        raise ValueError("--workers feeds an engine process: it cannot be combined with --engine-in-process")
    restart_flags = args.engine_max_restarts is not None or args.engine_restart_window_s is not None
    if restart_flags and args.engine_in_process:
        raise ValueError("--engine-in-process never restarts its engine: --engine-max-restarts and "
                         "--engine-restart-window-s apply to the engine process")
    restart_budget(args)  # ValueError for a negative count or a window that is not positive
    calls, webhooks = telephony.from_args(args)
    return ServerConfig(host=args.host, port=args.port, limits=limits, stream_limits=stream_limits,
                        defaults=defaults, web_root=find_web_root(args.web_root),
                        security=security.from_args(args), calls=calls, webhooks=webhooks,
                        admission=AdmissionSettings(enabled=args.admission_target_ms > 0))


def default_admission_target_ms(devices: list, device) -> float:
    """Admission control is for GPU engines; on the CPU (development, the tests) it is off unless asked for.
    devices: engine_load.engine_devices' answer ([None]: one engine on `device`, the resolved --device)."""
    on_gpu = any(str(d if d is not None else device).startswith("cuda") for d in devices)
    return LoadPolicy().target_ms if on_gpu else 0.0


def engine_options(args: argparse.Namespace) -> EngineOptions:
    from qasr.model.checkpoint import resolve_device  # imports torch

    slots = args.slots or (EngineOptions().num_slots if resolve_device(args.device).type == "cuda" else CPU_SLOTS)
    retained = slots if args.retained_slots is None else args.retained_slots
    return EngineOptions(num_slots=slots, max_len=args.max_len, num_retained=retained,
                         base_tokens=args.base_tokens,
                         tokens_per_second=args.tokens_per_second, ignore_eos=args.ignore_eos,
                         admission_interval_ms=args.admission_interval_ms, rollback_tokens=args.rollback_tokens,
                         decode_steps_ahead=args.decode_steps_ahead, decode_run_ahead=args.decode_run_ahead,
                         max_audio_seconds=max(60.0, args.max_segment_s + 5), aligner=args.aligner,
                         **number_formats(args))


async def serve(args: argparse.Namespace, config: ServerConfig, *, build=None, replica=None) -> int:
    """Serve until SIGTERM/SIGINT; 1 if the port cannot be bound or the model could not be loaded.
    build: what makes the engine pool (a front-end worker's: its connections to the engine processes); None: from
    args (an engine per device of --devices). replica: a worker's view of its siblings (qasr.server.workers)."""
    server = QasrServer(None, config, replica=replica)
    try:
        await server.start()
    except OSError as error:  # the port is taken, or the address is not this machine's
        log.error("cannot listen on %s:%d: %s", config.host, config.port, _bind_problem(error))
        return 1
    if config.web_root is None:
        log.warning("no web page found: / answers 404 (see --web-root)")
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: asyncio.ensure_future(server.stop()))
    if build is None:  # a worker's `build` pools its connections to the supervisor's engine processes itself
        build = engine_load.pool_factory(engine_factory(args), engine_load.engine_devices(args.device, args.devices),
                                         LoadPolicy(target_ms=args.admission_target_ms))
    try:
        loading = asyncio.ensure_future(server.load_engine(build))
        stopped = asyncio.ensure_future(server.wait_stopped())
        await asyncio.wait({loading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done() and loading.exception() is not None:
            log.error("cannot load model %s: %s", args.model, loading.exception())
            await server.stop()
            return 1
        await stopped
        return 0
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


# the engine options the server's flags set, checked before a model loads (engine.options.MINIMUMS)
ENGINE_FLAGS = {"num_slots": "--slots", "num_retained": "--retained-slots", "max_len": "--max-len",
                "admission_interval_ms": "--admission-interval-ms", "rollback_tokens": "--rollback-tokens",
                "decode_steps_ahead": "--decode-steps-ahead"}


def check_engine_flags(args: argparse.Namespace) -> None:
    """The engine's flags checked before serving: a usage error naming the flag, not a traceback from the engine
    process once the model has loaded."""
    for option, flag in ENGINE_FLAGS.items():
        value, least = getattr(args, flag[2:].replace("-", "_")), MINIMUMS[option]
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value:g}")


def engine_factory(args: argparse.Namespace, **serving):
    """What builds the engine from the arguments: on a thread of this process (--engine-in-process) or, by default,
    an EngineProcess whose logs go to the same stderr in the same format. serving: EngineProcess's restart budget,
    listen and health (qasr.server.workers)."""
    from qasr.engine.engine import AsyncEngine
    from qasr.engine.engine_process import EngineProcess

    options = engine_options(args)
    if args.engine_in_process:
        return functools.partial(AsyncEngine.from_pretrained, args.model, device=args.device, dtype=args.dtype,
                                 options=options)
    budget = restart_budget(args)
    return functools.partial(EngineProcess.from_pretrained, args.model, device=args.device, dtype=args.dtype,
                             options=options, log_setup=functools.partial(logs.configure, args.log_level,
                                                                          args.log_format),
                             max_restarts=budget.max_restarts, restart_window_s=budget.window_s, **serving)


def restart_budget(args: argparse.Namespace) -> RestartBudget:
    """The engine process's restart budget from --engine-max-restarts and --engine-restart-window-s (each defaulting
    to RestartBudget's); ValueError names the flag that is out of range."""
    default = RestartBudget()
    max_restarts = default.max_restarts if args.engine_max_restarts is None else args.engine_max_restarts
    window_s = default.window_s if args.engine_restart_window_s is None else args.engine_restart_window_s
    if max_restarts < 0:
        raise ValueError(f"--engine-max-restarts must be >= 0 (0: never restart), got {max_restarts}")
    if not window_s > 0:
        raise ValueError(f"--engine-restart-window-s must be > 0, got {window_s:g}")
    return RestartBudget(max_restarts, window_s)


def _bind_problem(error: OSError) -> str:
    """asyncio words a failed bind as 'error while attempting to bind on address (...): ...': the reason alone."""
    if error.errno == errno.EADDRINUSE:
        return "the port is in use (another qasr-server? stop it or pick another --port)"
    return os.strerror(error.errno) if isinstance(error.errno, int) and error.errno > 0 else str(error)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = build_config(args)
        check_engine_flags(args)
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    logs.configure(args.log_level, args.log_format)  # only once it will serve: it takes over the process's logging
    if args.workers > 1:
        from qasr.server import workers

        worker_argv = list(sys.argv[1:] if argv is None else argv)
        worker_argv += ["--admission-target-ms", f"{args.admission_target_ms:g}"]  # resolved here: workers hold no torch
        return workers.supervise(args, worker_argv, config)
    try:
        import uvloop
    except ImportError:  # Windows, or a minimal install: the standard loop works too
        return asyncio.run(serve(args, config))
    return uvloop.run(serve(args, config))


if __name__ == "__main__":
    sys.exit(main())
