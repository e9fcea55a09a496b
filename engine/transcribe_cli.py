"""`qasr-transcribe`: the command line of the offline transcriber (engine/transcribe.py).

Torch-free at import, so `--help` and argument errors answer at once: the transcriber, the model and the engine are
imported in `main` once the arguments are good.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .gc_pauses import freeze_loaded_heap, thaw  # torch-free
from .options import add_number_format_flags, number_formats  # torch-free

DEFAULT_MODEL = "Qwen/Qwen3-ASR-0.6B"
EXIT_OUTPUT_CLOSED = 141  # as a shell reports a tool that SIGPIPE stopped (128 + 13)
PROGRESS_MIN_FILES = 4  # with a TTY on stderr, show the bar for this many files or more ...
PROGRESS_MIN_SECONDS = 60.0  # ... or this much audio


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qasr-transcribe",
        description="Transcribe audio files with a Qwen3-ASR model. Prints `FILE: text` per file, or JSON lines.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="audio files (wav, flac, ogg, mp3, ...; any rate)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"checkpoint directory or Hugging Face id (default: {DEFAULT_MODEL})")
    parser.add_argument("--language", default=None, help="force the language (e.g. English); default: detect")
    parser.add_argument("--context", default="", help="context text for the prompt (names, terms, topic)")
    parser.add_argument("--device", default="auto", help="auto (the GPU if there is one), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU, fp32 on the CPU), float32, bfloat16, ...")
    parser.add_argument("--batch-size", type=int, default=32, help="pieces decoded together (default: 32)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="token limit per 30 s piece (default: ample for the piece's length)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per file: file, text, language, duration, segments (or file, error)")
    parser.add_argument("--words", action="store_true",
                        help="word times from a forced aligner (needs --aligner): `start-end word` lines after each "
                             "file's text, or `words` [{word, start, end}] in --json (seconds in the file)")
    parser.add_argument("--aligner", default=None, metavar="DIR_OR_ID",
                        help="Qwen3-ForcedAligner checkpoint for --words (e.g. Qwen/Qwen3-ForcedAligner-0.6B)")
    add_number_format_flags(parser, "more files a second at a large --batch-size; tokens may differ from bf16's")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: on for many or long files when stderr is a terminal)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        return _fail(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        return _fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.words and args.aligner is None:
        return _fail("--words needs --aligner DIR_OR_ID (e.g. Qwen/Qwen3-ForcedAligner-0.6B)")
    from qasr.model.audio import AudioError
    from qasr.model.prompt import UnsupportedLanguageError, normalize_language

    from .transcribe import Transcriber

    try:
        if args.language is not None and args.language.strip():
            args.language = normalize_language(args.language)
    except UnsupportedLanguageError as error:
        return _fail(str(error))

    present = [file for file in args.files if Path(file).is_file()]
    if not present:  # nothing to do: say why per file, without loading the model
        for file in args.files:
            reason = "expected an audio file, got a directory" if Path(file).exists() else "audio file not found"
            _report(args, file, AudioError(f"{reason}: {file}"))
        return 1

    from qasr.model.checkpoint import CheckpointError

    try:
        transcriber = Transcriber.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                                  max_batch=args.batch_size, max_new_tokens=args.max_new_tokens,
                                                  aligner=args.aligner, **number_formats(args))
    except (CheckpointError, ValueError, OSError, RuntimeError) as error:  # RuntimeError: FP8 or CUDA says why
        return _fail(f"cannot load model {args.model}: {error}")

    bar = _cli_progress_bar(args.progress, len(present), sum(_duration_hint(file) for file in present))
    # This process is the engine's, as the server's engine process is: a full collection would walk the loaded model
    # (130-180 ms with nothing on the GPU, an H100 at 512 rows, session 24), so the loaded heap is frozen for the run
    freeze_loaded_heap()
    try:
        failed = _transcribe_files(args, transcriber, bar)
    except KeyboardInterrupt:
        _close(bar)
        print("qasr-transcribe: interrupted", file=sys.stderr)
        return 130
    except ValueError as error:  # e.g. a context too long for the engine: the same for every file
        _close(bar)
        return _fail(str(error))
    except BrokenPipeError:  # `qasr-transcribe *.wav | head -3`: stop quietly, as the other tools of a pipeline do
        _close(bar)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else Python reports it again at exit
        return EXIT_OUTPUT_CLOSED
    finally:
        thaw()
    _close(bar)
    if failed:
        print(f"qasr-transcribe: {failed} of {len(args.files)} file(s) failed", file=sys.stderr)
    return 1 if failed else 0


def _transcribe_files(args, transcriber, bar) -> int:
    """Transcribe and print args.files in order, a batch's worth of files at a time (memory stays bounded and
    results appear as they are ready). Returns how many files failed."""
    import numpy as np

    from qasr.model.audio import AudioError

    from .transcribe import load_input

    failed = 0
    for start in range(0, len(args.files), args.batch_size):
        group = args.files[start : start + args.batch_size]
        outcomes: list = []  # per file: its clip, then its Transcription; or the AudioError that stopped it
        for file in group:
            try:
                outcomes.append(load_input(file))
            except AudioError as error:
                outcomes.append(error)
        clips = [o for o in outcomes if isinstance(o, np.ndarray)]
        if clips:
            results = iter(transcriber.transcribe_clips(clips, language=args.language, context=args.context,
                                                        progress=bar if bar is not None else False,
                                                        words=args.words))
            outcomes = [next(results) if isinstance(o, np.ndarray) else o for o in outcomes]
        for file, outcome in zip(group, outcomes):
            if isinstance(outcome, AudioError):
                failed += 1
                _report(args, file, outcome, bar)
            else:
                _print_result(args, file, outcome, bar)
    return failed


def _close(bar) -> None:
    if bar is not None:
        bar.close()


def _duration_hint(file: str) -> float:
    """Seconds of audio in `file` from its header (0 when it cannot be read: loading will report why)."""
    import soundfile

    try:
        return float(soundfile.info(file).duration)
    except Exception:
        return 0.0


def _cli_progress_bar(flag: bool | None, num_files: int, total_seconds: float):
    if flag is None:
        flag = sys.stderr.isatty() and (num_files >= PROGRESS_MIN_FILES or total_seconds >= PROGRESS_MIN_SECONDS)
    from .transcribe import progress_bar

    return progress_bar(bool(flag), max(total_seconds, 1.0))[0]


def _print_result(args, file: str, result, bar) -> None:
    if args.json:
        fields = {"file": file, "text": result.text, "language": result.language,
                  "duration": round(result.duration, 3),
                  "segments": [{"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text}
                               for s in result.segments]}
        if args.words:
            fields["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in result.words]
            if result.words_reason:
                fields["words_reason"] = result.words_reason
        line = json.dumps(fields, ensure_ascii=False)
    else:
        line = f"{file}: {result.text}"
        if args.words:
            line += "".join(f"\n  {w.start:.3f}-{w.end:.3f} {w.word}" for w in result.words)
            if result.words_reason:
                line += f"\n  (no word times: {result.words_reason})"
    _write(line, sys.stdout, bar)


def _report(args, file: str, error: Exception, bar=None) -> None:
    """A file that failed: one line on stderr (and a JSON object with `error` on stdout in --json mode)."""
    _write(f"qasr-transcribe: error: {error}", sys.stderr, bar)
    if args.json:
        _write(json.dumps({"file": file, "error": str(error)}, ensure_ascii=False), sys.stdout, bar)


def _write(line: str, stream, bar) -> None:
    if bar is not None:
        bar.write(line, file=stream)  # keeps the bar intact below the line
    else:
        print(line, file=stream, flush=True)


def _fail(message: str) -> int:
    message = " ".join(message.split())  # one line, even when a library's message had several
    print(f"qasr-transcribe: error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
