"""`qasr-bench`: benchmarks of the engine and of a running server, each a subcommand.

    qasr-bench offline --size 0.6B --official --out offline.json
    qasr-bench stream --url ws://127.0.0.1:8765/v1/stream --clients 32 --duration 60
    qasr-bench partial-reuse --size 0.6B --out reuse.json

The command line of `offline` and `partial-reuse` is declared here, apart from their torch-bound modules, so that
`--help` answers at once; `stream` (torch-free) keeps its own parser. Each module is imported only after parsing.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from qasr.engine.options import OFFLINE_DECODE_STEPS_AHEAD, add_number_format_flags

MODEL_SIZES = ("tiny", "0.6B", "1.7B")
OFFLINE_MAX_LEN = 320  # KV positions a slot in the offline benches: a 10.9 s clip's prompt and 40 tokens fit
DEVICE_HELP = "auto (the GPU if there is one), cpu, cuda, cuda:N (default: %(default)s)"
DTYPE_HELP = "auto (bfloat16 on a GPU, float32 on the CPU), float32, bfloat16, float16 (default: %(default)s)"

# name -> (module, one line for `qasr-bench --help`)
COMMANDS = {
    "offline": ("qasr.bench.offline", "engine latency, throughput, decode-step time and row correctness on a random "
                                      "checkpoint, beside the official backend"),
    "stream": ("qasr.bench.stream", "N live clients against a running server and the latencies each sees"),
    "partial-reuse": ("qasr.bench.partial_reuse", "what a stream's cached encoder windows and KV save its partials"),
}


def offline_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qasr-bench offline",
        description="Engine latency (batch 1), throughput (all clips queued at once), decode-step time per CUDA graph "
                    "bucket against the memory-bandwidth floor, and row correctness, on a random checkpoint with the "
                    "real shapes and decoding forced to --tokens tokens; the official qwen-asr backend in the same "
                    "run with --official. Prints JSON (and writes it with --out).")
    p.add_argument("--size", default="0.6B", choices=MODEL_SIZES,
                   help="shapes of the generated random checkpoint (default: %(default)s)")
    p.add_argument("--model", help="benchmark this checkpoint (folder) instead of generating one")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--clip-seconds", type=float, default=10.9,
                   help="length of each synthetic speech-like clip (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=40, help="tokens decoded per clip, EOS ignored (default: %(default)s)")
    p.add_argument("--num-clips", type=int, default=1000,
                   help="clips in the throughput run, all queued at once (default: %(default)s)")
    p.add_argument("--slots", type=int, default=256,
                   help="engine decode slots: the largest batch and CUDA graph (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=OFFLINE_MAX_LEN,
                   help="KV positions per slot: prompt + --tokens must fit (default: %(default)s)")
    p.add_argument("--prefill-tokens", type=int, default=32768,
                   help="prompt tokens prefilled in one admission round (default: %(default)s)")
    p.add_argument("--decode-steps-ahead", type=int,
                   help="decode steps queued beside an admission's host work, at most (default: the engine's offline "
                        f"value, {OFFLINE_DECODE_STEPS_AHEAD})")
    p.add_argument("--admission-interval-ms", type=float,
                   help="decoding between two admissions, ms (default: the engine's)")
    p.add_argument("--no-decode-run-ahead", dest="decode_run_ahead", action="store_false", default=None,
                   help="read each decode step before queuing the next (default: offline's run-ahead, the next step "
                        "queued before the last is read)")
    add_number_format_flags(p, "the correctness checks then also compare the tokens with bf16's", default=None)
    p.add_argument("--freeze-heap", action=argparse.BooleanOptionalAction, default=True,
                   help="freeze the loaded engine's objects out of Python's collector (gc.freeze), as qasr-transcribe "
                        "and the server's engine process do (default: on; --no-freeze-heap leaves them to it, as a "
                        "script using the Transcriber has them)")
    p.add_argument("--context", type=int, default=200,
                   help="cached tokens per row while the decode step is timed, GPU only (default: %(default)s)")
    p.add_argument("--latency-runs", type=int, default=20,
                   help="batch-1 runs; the median is reported (default: %(default)s)")
    p.add_argument("--step-runs", type=int, default=50,
                   help="replays per decode-step bucket; the median is reported (default: %(default)s)")
    p.add_argument("--independence-requests", type=int, default=200,
                   help="requests of mixed lengths decoded together and each alone, compared token by token "
                        "(default: %(default)s)")
    p.add_argument("--eager-requests", type=int, default=40,
                   help="of those, how many are also decoded by the plain eager batch-1 path, the reference "
                        "(default: %(default)s)")
    p.add_argument("--official", action="store_true", help="time the official qwen-asr backend in the same run")
    p.add_argument("--official-batch", type=int, default=128,
                   help="the official backend's batch size (default: %(default)s)")
    p.add_argument("--official-clips", type=int, default=512,
                   help="clips in the official backend's throughput run (default: %(default)s)")
    p.add_argument("--timeline", action="store_true",
                   help="run the throughput run once more under torch's profiler: how busy the GPU was, per CUDA "
                        "stream (decoding, admissions), and its top kernels (default: off)")
    p.add_argument("--out", metavar="JSON", help="also write the results here")
    return p


def partial_reuse_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qasr-bench partial-reuse",
        description="One segment growing to --seconds with a partial every --interval, decoded with and without "
                    "partial reuse (a stream's cached encoder windows and prompt+audio KV): encoder windows, prefilled "
                    "positions and wall time per partial and in total. Random weights, decoding forced to --tokens.")
    p.add_argument("--size", default="tiny", choices=MODEL_SIZES,
                   help="shapes of the generated random checkpoint (default: %(default)s)")
    p.add_argument("--model", help="use this checkpoint (folder) instead of generating one")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--seconds", type=float, default=30.0, help="length the segment grows to (default: %(default)s)")
    p.add_argument("--interval", type=float, default=1.0,
                   help="new audio between partials, seconds (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=8, help="tokens decoded per partial, EOS ignored (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=1024, help="KV positions of the one slot (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic speech-like audio (default: %(default)s)")
    p.add_argument("--no-loud-start", action="store_true",
                   help="leave the audio as synthesized: louder syllables arriving later raise the clip maximum, which "
                        "moves the mel floor and costs the partials it reaches a fresh encode and prefill (default: the "
                        "loudest stretch is put in the first second)")
    p.add_argument("--at", default="2,8,16,30",
                   help="segment lengths (s, comma-separated) whose partial's admission is reported (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of the growing segment; per partial the median is reported (default: %(default)s)")
    p.add_argument("--out", metavar="JSON", help="also write the results here")
    return p


# The subcommands whose options this module declares; the module's run(args) does the work.
PARSERS = {"offline": offline_parser, "partial-reuse": partial_reuse_parser}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qasr-bench", description="Benchmarks of the engine and of a running server.",
                                     epilog="qasr-bench COMMAND --help lists that command's options.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, summary) in COMMANDS.items():
        # the command's own parser reads the rest of the line (and answers its --help)
        commands.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    chosen, rest = build_parser().parse_known_args(argv)
    module = COMMANDS[chosen.command][0]
    if chosen.command not in PARSERS:  # stream: its own main() parses and checks its options
        importlib.import_module(module).main(rest)
        return
    args = PARSERS[chosen.command]().parse_args(rest)
    importlib.import_module(module).run(args)


if __name__ == "__main__":
    main()
