"""qasr-mic: live transcription of a microphone (or a file) from a qasr server, in the terminal.

    qasr-mic                                  # default microphone, ws://127.0.0.1:8765/v1/stream
    qasr-mic --device 2 --language English --output talk.txt
    qasr-mic --file talk.wav --speed 4 --jsonl
    qasr-mic --words                          # each final's word times (a server started with --aligner)
    QASR_API_KEY=... qasr-mic --url wss://asr.example.com/v1/stream     # a server that requires an API key

On a terminal the growing partial is rewritten in place on one line; each final is committed on its own line as
`[12.34-15.67] text`; with --words an indented line follows with each word's start in stream seconds
(`word@12.41 ...`), or why the final has none. --jsonl prints (or, with --output, writes) one JSON object per final
instead. Ctrl-C ends the stream cleanly: the last segment's final still arrives before qasr-mic exits 0 (a second Ctrl-C quits at once).

The API key (for a server that requires one) comes from --api-key or, better, $QASR_API_KEY, which a process
listing does not show; the flag wins. It is sent as `Authorization: Bearer` and never printed.

Exit codes: 0 done; 1 the server closed or lost the stream (after --reconnect attempts, if any); 2 usage;
3 no server reachable; 4 no usable audio input (no microphone, no PortAudio, unreadable file); 5 the server refused
the connection (no or a wrong API key, forbidden, too many connections); 130 interrupted twice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import unicodedata
from pathlib import Path
from typing import TextIO

from qasr.client.errors import (AudioSourceError, AuthenticationFailed, HandshakeRefused, ServerUnreachable,
                                StreamClosed)
from qasr.client.protocol import Credentials
from qasr.client.sources import file_source, list_input_devices, microphone_source
from qasr.client.stream import AudioDropped, Reconnecting, StreamEvent, stream_audio
from qasr.streaming.events import Error, Final, Partial, Ready, Summary

DEFAULT_URL = "ws://127.0.0.1:8765/v1/stream"
API_KEY_ENV = "QASR_API_KEY"
EXIT_OK, EXIT_STREAM_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NO_AUDIO, EXIT_REFUSED, EXIT_INTERRUPTED = \
    0, 1, 2, 3, 4, 5, 130
EXIT_OUTPUT_CLOSED = 141  # as a shell reports a tool that SIGPIPE stopped (128 + 13)
CLEAR_LINE = "\r\x1b[K"  # carriage return + erase to the end of the line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qasr-mic", description=__doc__.split("\n\n")[0],
                                     epilog="Exit codes: 0 done, 1 stream closed or lost, 2 usage, 3 no server, "
                                            "4 no audio input, 5 refused (API key, forbidden, too many "
                                            "connections), 130 interrupted twice, 141 stdout closed (the reader "
                                            "of a pipe left).")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the server's stream URL (default {DEFAULT_URL})")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"API key for a server that requires one (default ${API_KEY_ENV}, which a process "
                             "listing does not show; this flag wins)")
    parser.add_argument("--device", default=None, help="input device: a number or part of a name (--list-devices)")
    parser.add_argument("--list-devices", action="store_true", help="list the input devices and exit")
    parser.add_argument("--language", default=None, help="force a language (e.g. English); default: detect")
    parser.add_argument("--context", default="", help="names, topic or spellings the model should prefer")
    parser.add_argument("--output", default=None, help="also write each final to this file (appended)")
    parser.add_argument("--jsonl", action="store_true",
                        help="finals as JSON lines with timings (to --output if given, else to stdout)")
    parser.add_argument("--file", default=None, help="stream this audio file instead of the microphone")
    parser.add_argument("--speed", type=float, default=1.0, help="with --file: N times faster than real time")
    parser.add_argument("--no-partials", action="store_true", help="only finals (no live line)")
    parser.add_argument("--words", action="store_true",
                        help="word times on every final: `word@start` under its line, `words` in --jsonl (needs a "
                             "server started with --aligner)")
    parser.add_argument("--reconnect", type=int, default=0, metavar="N",
                        help="if the server drops the stream (restart, shutdown), reopen it up to N times in a row; "
                             "default 0: report it and exit 1")
    return parser


class TranscriptPrinter:
    """Shows events: the live partial on one rewritten line (terminals only), finals committed line by line,
    finals written to the output file. Partials are keyed by segment: a later segment may start before an
    earlier one's final arrives."""

    def __init__(self, out: TextIO, *, live: bool, jsonl: bool = False, output: TextIO | None = None):
        self.out = out
        self.live = live  # rewrite a partial line (stdout is a terminal and partials are wanted)
        self.jsonl = jsonl
        self.output = output
        self.partials: dict[int, str] = {}  # segment_id -> latest partial text
        self.finals = 0
        self._line_shown = False

    def show(self, event: StreamEvent) -> None:
        if isinstance(event, Partial):
            self.partials[event.segment_id] = event.text
            self._redraw()
        elif isinstance(event, Final):
            self.partials.pop(event.segment_id, None)
            self._commit(event)
            self._redraw()

    def clear_line(self) -> None:
        """Before anything else is printed to the terminal."""
        if self._line_shown:
            self.out.write(CLEAR_LINE)
            self.out.flush()
            self._line_shown = False

    def _commit(self, final: Final) -> None:
        self.finals += 1
        fields = {"segment_id": final.segment_id, "start": round(final.start, 3), "end": round(final.end, 3),
                  "text": final.text, "language": final.language, "reason": final.reason,
                  "latency_ms": final.latency_ms}
        if final.words is not None:  # the stream asked for word times
            fields["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in final.words]
            if final.words_reason:
                fields["words_reason"] = final.words_reason
        record = json.dumps(fields, ensure_ascii=False)
        line = f"[{final.start:.2f}-{final.end:.2f}] {final.text}" + _word_times(final)
        if self.output is not None:  # flushed per final, and first: an interrupted run (or a closed stdout) keeps
            self.output.write((record if self.jsonl else final.text) + "\n")  # everything it heard
            self.output.flush()
        self.clear_line()
        self.out.write((record if self.jsonl and self.output is None else line) + "\n")
        self.out.flush()

    def _redraw(self) -> None:
        if not self.live:
            return
        text = " ".join(self.partials[segment] for segment in sorted(self.partials)).strip()
        width = shutil.get_terminal_size((80, 24)).columns - 1
        self.out.write(CLEAR_LINE + _tail_fitting(text, width))
        self.out.flush()
        self._line_shown = bool(text)


def _word_times(final: Final) -> str:
    """An indented line under a final of a stream that asked for words: `word@start` each, or why there are none;
    "" for a stream that did not ask."""
    if final.words is None:
        return ""
    if not final.words:
        return f"\n    (no word times: {final.words_reason or 'none given'})"
    return "\n    " + " ".join(f"{word.word}@{word.start:.2f}" for word in final.words)


def _tail_fitting(text: str, width: int) -> str:
    """The end of `text` that fits in `width` terminal cells (wide CJK characters take two), so the live line
    never wraps (a wrapped line cannot be rewritten with a carriage return)."""
    cells = [2 if unicodedata.east_asian_width(character) in "WF" else 1 for character in text]
    if sum(cells) <= width:
        return text
    used, start = 1, len(text)  # one cell for the ellipsis
    while start > 0 and used + cells[start - 1] <= width:
        start -= 1
        used += cells[start]
    return "…" + text[start:]


def note(message: str) -> None:
    print(f"qasr-mic: {message}", file=sys.stderr, flush=True)


async def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    if args.file and (problem := _file_problem(args.file)):
        note(problem)
        return EXIT_NO_AUDIO
    try:
        if args.file:
            source = file_source(args.file, realtime=True, speed=args.speed)
        else:
            source = microphone_source(_device(args.device))
    except AudioSourceError as error:
        note(str(error))
        return EXIT_NO_AUDIO
    stream = stream_audio(args.url, source, language=args.language, context=args.context,
                          partials=not args.no_partials, words=args.words, reconnect=args.reconnect,
                          api_key=_api_key(args))
    output = open(args.output, "a", encoding="utf-8") if args.output else None
    printer = TranscriptPrinter(out, live=out.isatty() and not args.no_partials and not args.jsonl,
                                jsonl=args.jsonl, output=output)
    interrupted = _on_interrupt(stream, printer)
    logging.getLogger("qasr.client").addHandler(logging.NullHandler())  # its warnings reach people as events, below
    warned_of_drops = False
    try:
        async for event in stream:
            if isinstance(event, AudioDropped) and not warned_of_drops:  # once: the rest says nothing new
                printer.clear_line()
                note(f"warning: the stream fell more than 30 s behind the microphone (server or network too "
                     f"slow); {event.dropped_s:.1f} s of the oldest audio was dropped, unsent")
                warned_of_drops = True
            _report(event, printer, source_is_file=bool(args.file))
            printer.show(event)
        return EXIT_OK
    except ServerUnreachable as error:
        printer.clear_line()
        note(str(error))
        return EXIT_UNREACHABLE
    except HandshakeRefused as error:
        printer.clear_line()
        note(_refusal(error, args))
        return EXIT_REFUSED
    except StreamClosed as error:
        printer.clear_line()
        note(f"{error}; {printer.finals} final(s) received" + ("" if args.reconnect == 0 else
                                                               f" (gave up after {args.reconnect} reconnects)")
             + (" (--words needs a server started with --aligner)" if _words_refused(error) else ""))
        return EXIT_STREAM_FAILED
    except AudioSourceError as error:
        printer.clear_line()
        note(str(error))
        return EXIT_NO_AUDIO
    finally:
        interrupted.remove()
        if output is not None:
            output.close()


def _report(event: StreamEvent, printer: TranscriptPrinter, *, source_is_file: bool) -> None:
    """Status for people on stderr (stdout carries only transcripts)."""
    if isinstance(event, Ready):
        what = "streaming the file" if source_is_file else "listening; Ctrl-C to stop"
        printer.clear_line()
        note(f"connected to {event.model} (session {event.session_id}); {what}")
    elif isinstance(event, Reconnecting):
        printer.clear_line()
        note(f"{event.reason}; reconnecting in {event.delay_s:g} s (attempt {event.attempt}/{event.max_attempts})")
    elif isinstance(event, Error):
        printer.clear_line()
        note(f"server {'error' if event.fatal else 'warning'} {event.code}: {event.message}")
    elif isinstance(event, Summary):
        printer.clear_line()
        note(f"done: {event.segments} segment(s), {event.audio_seconds:.1f} s of audio")


class _on_interrupt:
    """Ctrl-C (and SIGTERM) end the stream cleanly; a second one quits at once."""

    def __init__(self, stream, printer: TranscriptPrinter):
        self.loop = asyncio.get_running_loop()
        self.stream = stream
        self.printer = printer
        self.task = asyncio.current_task()
        self.signals = []
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                self.loop.add_signal_handler(signum, self._handle)
                self.signals.append(signum)
            except (NotImplementedError, RuntimeError):  # Windows, or not the main thread
                pass

    def _handle(self) -> None:
        if self.stream.stopping:
            self.task.cancel()
            return
        self.printer.clear_line()
        note("stopping: waiting for the last final (Ctrl-C again to quit now)")
        self.stream.stop()

    def remove(self) -> None:
        for signum in self.signals:
            self.loop.remove_signal_handler(signum)


def _words_refused(error: StreamClosed) -> bool:
    """The server turned the stream away because it cannot time words (1003 unsupported, about words)."""
    return (error.code == 1003 and error.error is not None and error.error.code == "unsupported"
            and "word" in error.error.message)


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $QASR_API_KEY (an empty variable counts as unset)."""
    return args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None


def _refusal(error: HandshakeRefused, args: argparse.Namespace) -> str:
    """A refused handshake in qasr-mic's words: which option to fix (never the key itself)."""
    if not isinstance(error, AuthenticationFailed):
        return str(error)
    if error.credential is None:  # the server's reason lists every way to send one: say qasr-mic's
        return f"{args.url} requires an API key (HTTP 401); give it with --api-key KEY or ${API_KEY_ENV}"
    reason = f": {error.message}" if error.message else ""
    source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
    return f"{args.url} did not accept the API key from {source} (HTTP 401{reason}); check it"


def _file_problem(path: str) -> str | None:
    """Why `path` cannot be streamed, in qasr-transcribe's words, before a decoder library words it (None: a file)."""
    if Path(path).is_file():
        return None
    return f"{'expected an audio file, got a directory' if Path(path).exists() else 'audio file not found'}: {path}"


def _device(text: str | None) -> int | str | None:
    return int(text) if text is not None and text.strip().isdigit() else text


def _list_devices() -> int:
    try:
        devices = list_input_devices()
    except AudioSourceError as error:
        note(str(error))
        return EXIT_NO_AUDIO
    if not devices:
        note("no input devices found")
        return EXIT_NO_AUDIO
    for device in devices:
        default = "*" if device.is_default else " "
        print(f"{default} {device.index:3d}  {device.name}  ({device.channels} ch, {device.default_sample_rate:g} Hz)")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.speed <= 0:
        build_parser().error(f"--speed must be > 0, got {args.speed}")
    if args.reconnect < 0:
        build_parser().error(f"--reconnect must be >= 0, got {args.reconnect}")
    if not args.url.startswith(("ws://", "wss://")):
        build_parser().error(f"--url must start with ws:// or wss://, got {args.url!r}")
    try:
        Credentials(api_key=_api_key(args))
    except ValueError as error:  # says what is wrong without showing the key
        build_parser().error(f"{'--api-key' if args.api_key is not None else '$' + API_KEY_ENV}: {error}")
    if args.list_devices:
        return _list_devices()
    try:
        return asyncio.run(run(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        note("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `qasr-mic | head -3`: stop quietly, as the other tools of a pipeline do
        _silence_stdout()
        return EXIT_OUTPUT_CLOSED


def _silence_stdout() -> None:
    """Point stdout at /dev/null: else Python reports the closed pipe again when it flushes stdout at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
