"""qasr-mic end to end against a running server (on a thread of the test process): in-process through main(),
and as a subprocess through the installed console script for the signal and terminal paths (Ctrl-C mid-speech
loses no final, a server that stops or vanishes mid-stream gives one clear line and exit 1, a terminal gets the
rewritten partial line). The microphone path is checked with a stand-in sounddevice (no PortAudio, no device),
and with the real one on a PulseAudio null sink where PulseAudio can run (tests/client/test_sources.py)."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import soundfile

from qasr.client import mic, sources
from qasr.client.mic import CLEAR_LINE, TranscriptPrinter
from qasr.streaming.events import Final, Partial
from qasr.engine.request import Priority

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine, speech_like, stand_in_sounddevice
from live_server import ThreadedServer, abort_connections, real_engine, requiring_key, spoken_wav, wait_until

TWO_BURSTS = [("silence", 0.4), ("speech", 1.2), ("silence", 0.8), ("speech", 1.0), ("silence", 0.8)]
QASR_MIC = Path(sys.executable).with_name("qasr-mic")


def write_wav(path: Path, pattern) -> list[tuple[float, float]]:
    audio, truth = speech_like(pattern)
    soundfile.write(str(path), audio, 16000, subtype="PCM_16")
    return truth


@pytest.fixture
def server():
    with ThreadedServer(lambda: FakeEngine(delay_s=0.005)) as running:
        yield running


def final_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[")]


def parse_final_line(line: str) -> tuple[float, float, str]:
    times, text = line[1:].split("] ", 1)
    start, end = times.split("-")
    return float(start), float(end), text


def in_second_segment(engine: FakeEngine) -> bool:
    """The server asked for a partial after the first final: a second segment is open."""
    priorities = [call.request.priority for call in engine.calls]
    return Priority.FINAL in priorities and Priority.PARTIAL in priorities[priorities.index(Priority.FINAL):]


def start_mic(*args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    if not QASR_MIC.exists():
        pytest.skip(f"the qasr-mic console script is not installed beside {sys.executable} (pip install -e .)")
    return subprocess.Popen([str(QASR_MIC), *args], stdout=stdout, stderr=subprocess.PIPE, text=True)


def read_until(stream, predicate, timeout: float = 15.0) -> str:
    """Lines from a subprocess pipe until one satisfies `predicate`; all of them, joined."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.1)
        if ready:
            line = stream.readline()
            if not line:
                break
            seen.append(line)
            if predicate(line):
                return "".join(seen)
    raise AssertionError(f"no matching line within {timeout} s; got {seen!r}")


# -- in-process ------------------------------------------------------------------------------------------------


def test_a_file_prints_each_final_with_its_times_and_writes_the_output_file(server, tmp_path, capsys):
    truth = write_wav(tmp_path / "talk.wav", TWO_BURSTS)
    out = tmp_path / "transcript.txt"
    code = mic.main(["--url", server.url, "--file", str(tmp_path / "talk.wav"), "--speed", "8", "--output", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0
    finals = [parse_final_line(line) for line in final_lines(stdout)]
    assert len(finals) == 2 and len(stdout.splitlines()) == 2  # not a terminal: no partial lines
    for (start, end, text), (true_start, true_end) in zip(finals, truth):
        assert start <= true_start and end == pytest.approx(true_end, abs=0.1)
        assert text == f"{end - start:.2f}s"  # the fake engine's transcript: the segment's length
    assert out.read_text().splitlines() == [text for _, _, text in finals]
    assert "connected to fake-qwen3-asr" in stderr and "done: 2 segment(s)" in stderr


def test_jsonl_goes_to_stdout_or_to_the_output_file_with_timings(server, tmp_path, capsys):
    write_wav(tmp_path / "talk.wav", TWO_BURSTS)
    assert mic.main(["--url", server.url, "--file", str(tmp_path / "talk.wav"), "--speed", "8", "--jsonl",
                     "--no-partials"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [record["segment_id"] for record in records] == [0, 1]
    assert set(records[0]) == {"segment_id", "start", "end", "text", "language", "reason", "latency_ms"}
    assert all(record["reason"] == "silence" and record["end"] > record["start"] for record in records)

    out = tmp_path / "finals.jsonl"
    assert mic.main(["--url", server.url, "--file", str(tmp_path / "talk.wav"), "--speed", "8", "--jsonl",
                     "--output", str(out)]) == 0
    stdout = capsys.readouterr().out
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["start"], r["end"], r["text"]) for r in written] == [(r["start"], r["end"], r["text"]) for r in records]
    assert len(final_lines(stdout)) == 2  # the terminal still shows [start-end] text


def test_no_server_is_one_line_and_exit_3(tmp_path, capsys):
    write_wav(tmp_path / "talk.wav", TWO_BURSTS)
    with ThreadedServer(lambda: FakeEngine()) as gone:
        url = gone.url
    assert mic.main(["--url", url, "--file", str(tmp_path / "talk.wav")]) == mic.EXIT_UNREACHABLE
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and "connection refused; is qasr-server running there?" in stderr


KEY = "mic-test-key-0123456789abcdef"
WRONG_KEY = "not-the-mic-key-0123456789"


@pytest.fixture
def keyed_server(monkeypatch):
    monkeypatch.delenv(mic.API_KEY_ENV, raising=False)
    with ThreadedServer(lambda: FakeEngine(delay_s=0.005), security=requiring_key(KEY)) as running:
        yield running


def with_environment_key(monkeypatch, key: str | None) -> None:
    if key is not None:
        monkeypatch.setenv(mic.API_KEY_ENV, key)


@pytest.mark.parametrize("flag, environment", [(["--api-key", KEY], None), ([], KEY), (["--api-key", KEY], WRONG_KEY)])
def test_the_api_key_from_the_flag_or_the_environment_opens_the_stream(keyed_server, tmp_path, capsys, monkeypatch,
                                                                       flag, environment):
    write_wav(tmp_path / "talk.wav", TWO_BURSTS)
    with_environment_key(monkeypatch, environment)
    code = mic.main(["--url", keyed_server.url, "--file", str(tmp_path / "talk.wav"), "--speed", "8", *flag])
    stdout, stderr = capsys.readouterr()
    assert code == mic.EXIT_OK, stderr
    assert len(final_lines(stdout)) == 2 and KEY not in stdout + stderr


@pytest.mark.parametrize("flag, environment, says", [
    ([], None, "requires an API key (HTTP 401); give it with --api-key KEY or $QASR_API_KEY"),
    ([], "", "requires an API key"),  # an empty variable is no key, not a usage error
    (["--api-key", WRONG_KEY], None, "did not accept the API key from --api-key (HTTP 401: the API key is not valid)"),
    ([], WRONG_KEY, "did not accept the API key from $QASR_API_KEY"),
    (["--api-key", WRONG_KEY], KEY, "did not accept the API key from --api-key"),  # the flag wins
])
def test_a_missing_or_wrong_key_is_one_line_and_exit_5_never_retried_and_never_printed(keyed_server, tmp_path,
                                                                                        capsys, monkeypatch, flag,
                                                                                        environment, says):
    write_wav(tmp_path / "talk.wav", TWO_BURSTS)
    with_environment_key(monkeypatch, environment)
    code = mic.main(["--url", keyed_server.url, "--file", str(tmp_path / "talk.wav"), "--reconnect", "3", *flag])
    stdout, stderr = capsys.readouterr()
    assert code == mic.EXIT_REFUSED
    assert stdout == "" and stderr.count("\n") == 1 and says in stderr, stderr  # no reconnecting, no traceback
    assert KEY not in stderr and WRONG_KEY not in stderr


@pytest.mark.parametrize("flag, environment, names", [(["--api-key", ""], None, "--api-key"),
                                                      (["--api-key", "my secret key"], None, "--api-key"),
                                                      ([], "my secret\nkey", "$QASR_API_KEY")])
def test_an_unusable_key_is_a_usage_error_that_does_not_show_it(capsys, monkeypatch, flag, environment, names):
    monkeypatch.delenv(mic.API_KEY_ENV, raising=False)
    with_environment_key(monkeypatch, environment)
    with pytest.raises(SystemExit) as caught:
        mic.main(["--file", "x.wav", *flag])
    stderr = capsys.readouterr().err
    assert caught.value.code == mic.EXIT_USAGE and f"error: {names}:" in stderr and "secret" not in stderr


def test_a_server_that_vanishes_mid_stream_is_one_line_and_exit_1(server, tmp_path, capsys):
    write_wav(tmp_path / "long.wav", [("silence", 0.3), ("speech", 1.0), ("silence", 0.8), ("speech", 20.0)])
    def vanish_mid_second_segment():
        wait_until(lambda: in_second_segment(server.server.engine), timeout=20)
        server.loop.call_soon_threadsafe(abort_connections, server.server)

    killer = threading.Thread(target=vanish_mid_second_segment)
    killer.start()
    code = mic.main(["--url", server.url, "--file", str(tmp_path / "long.wav"), "--speed", "5"])
    killer.join()
    stdout, stderr = capsys.readouterr()
    assert code == mic.EXIT_STREAM_FAILED
    assert len(final_lines(stdout)) == 1
    assert stderr.splitlines()[-1] == "qasr-mic: the connection to the server was lost (no close frame from the " \
                                      "server); 1 final(s) received"


def test_a_missing_portaudio_or_microphone_is_one_line_and_exit_4(monkeypatch, capsys):
    def no_portaudio():
        raise sources.AudioSourceError("cannot load PortAudio (PortAudio library not found): install it")

    monkeypatch.setattr(sources, "_sounddevice", no_portaudio)
    assert mic.main(["--url", "ws://127.0.0.1:9/v1/stream"]) == mic.EXIT_NO_AUDIO
    assert mic.main(["--list-devices"]) == mic.EXIT_NO_AUDIO
    assert capsys.readouterr().err.count("qasr-mic: cannot load PortAudio") == 2

    class PortAudioError(Exception):
        pass

    def query_devices(device=None, kind=None):
        if kind == "input":
            raise PortAudioError("Error querying device -1")
        return []

    no_devices = types.SimpleNamespace(PortAudioError=PortAudioError, query_devices=query_devices,
                                       default=types.SimpleNamespace(device=(-1, -1)))
    monkeypatch.setattr(sources, "_sounddevice", lambda: no_devices)
    assert mic.main(["--url", "ws://127.0.0.1:9/v1/stream"]) == mic.EXIT_NO_AUDIO
    assert mic.main(["--list-devices"]) == mic.EXIT_NO_AUDIO
    stderr = capsys.readouterr().err.splitlines()
    assert stderr[0].startswith("qasr-mic: no microphone found") and "--list-devices" in stderr[0]
    assert stderr[1] == "qasr-mic: no input devices found"


def test_a_missing_file_or_a_folder_is_one_line_as_qasr_transcribe_words_it_and_exit_4(tmp_path, capsys):
    missing = tmp_path / "nosuch.wav"
    assert mic.main(["--url", "ws://127.0.0.1:9/v1/stream", "--file", str(missing)]) == mic.EXIT_NO_AUDIO
    assert capsys.readouterr().err == f"qasr-mic: audio file not found: {missing}\n"
    assert mic.main(["--url", "ws://127.0.0.1:9/v1/stream", "--file", str(tmp_path)]) == mic.EXIT_NO_AUDIO
    assert capsys.readouterr().err == f"qasr-mic: expected an audio file, got a directory: {tmp_path}\n"


@pytest.mark.parametrize("argv", [["--speed", "0", "--file", "x.wav"], ["--url", "http://host/v1/stream"],
                                  ["--reconnect", "-1"]])
def test_bad_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        mic.main(argv)
    assert caught.value.code == mic.EXIT_USAGE and "qasr-mic" in capsys.readouterr().err


def test_the_live_line_is_rewritten_and_finals_are_committed():
    class Terminal:
        def __init__(self):
            self.written = []

        def write(self, text):
            self.written.append(text)

        def flush(self):
            pass

    terminal = Terminal()
    printer = TranscriptPrinter(terminal, live=True)
    printer.show(Partial(0, "hello", "English", 0.0, 1.0))
    printer.show(Partial(1, "and", "English", 2.0, 2.5))  # a later segment before the earlier final
    printer.show(Final(0, "Hello world.", "English", 0.2, 1.7, "silence", 80.0))
    assert terminal.written[0] == CLEAR_LINE + "hello"
    assert terminal.written[1] == CLEAR_LINE + "hello and"
    assert terminal.written[2:5] == [CLEAR_LINE, "[0.20-1.70] Hello world.\n", CLEAR_LINE + "and"]


# -- subprocesses ----------------------------------------------------------------------------------------------


def test_the_console_script_streams_a_file_with_the_real_engine(tiny_model_dir, tmp_path):
    truth = spoken_wav(tmp_path / "spoken.wav", ["hello there", "general kenobi"])
    out = tmp_path / "finals.jsonl"
    with ThreadedServer(lambda: real_engine(tiny_model_dir)) as server:
        process = start_mic("--url", server.url, "--file", str(tmp_path / "spoken.wav"), "--speed", "4",
                            "--output", str(out), "--jsonl")
        stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    finals = [parse_final_line(line) for line in final_lines(stdout)]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(finals) == len(written) == len(truth)
    for (start, end, text), record in zip(finals, written):
        assert (start, end, text) == (pytest.approx(record["start"], abs=0.006),
                                      pytest.approx(record["end"], abs=0.006), record["text"])
    assert "Traceback" not in stderr


def test_a_closed_stdout_stops_quietly_with_exit_141_and_the_output_file_keeps_the_final(server, tmp_path):
    """`qasr-mic --file F --output talk.txt | head -1` once head has left: no traceback, exit 141 (as a shell reports
    a tool that SIGPIPE stopped), and the final whose print failed is in the output file (written first)."""
    spoken_wav(tmp_path / "spoken.wav", ["hello there", "general kenobi"])
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has left before the first final: that print fails whatever the timing
    try:
        process = start_mic("--url", server.url, "--file", str(tmp_path / "spoken.wav"), "--speed", "4",
                            "--output", str(tmp_path / "talk.txt"), stdout=write_end)
        _, stderr = process.communicate(timeout=60)
    finally:
        os.close(write_end)
    assert process.returncode == 141, stderr
    assert "Traceback" not in stderr and "Broken pipe" not in stderr
    assert len((tmp_path / "talk.txt").read_text().splitlines()) == 1


def test_ctrl_c_mid_speech_ends_cleanly_and_the_open_segments_final_is_kept(server, tmp_path):
    write_wav(tmp_path / "long.wav", [("silence", 0.3), ("speech", 1.0), ("silence", 0.8), ("speech", 30.0)])
    out = tmp_path / "finals.jsonl"
    process = start_mic("--url", server.url, "--file", str(tmp_path / "long.wav"), "--output", str(out), "--jsonl")
    try:
        shown = read_until(process.stdout, lambda line: line.startswith("[0."))  # the first final, in real time
        time.sleep(1.0)  # well inside the second burst
        process.send_signal(signal.SIGINT)
        rest, stderr = process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert len(final_lines(shown + rest)) == 2
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(record["segment_id"], record["reason"]) for record in records] == [(0, "silence"), (1, "end")]
    assert records[1]["end"] < 10  # the stream stopped at Ctrl-C, not at the end of the file
    assert "stopping: waiting for the last final" in stderr and "done: 2 segment(s)" in stderr
    assert "Traceback" not in stderr


def test_a_server_shutting_down_mid_stream_is_a_clean_message_and_exit_1(tmp_path):
    # long enough that the file cannot run out before the stop, however loaded the machine
    write_wav(tmp_path / "long.wav", [("silence", 0.3), ("speech", 1.0), ("silence", 0.8), ("speech", 120.0)])
    with ThreadedServer(lambda: FakeEngine(delay_s=0.005)) as server:
        process = start_mic("--url", server.url, "--file", str(tmp_path / "long.wav"), "--speed", "2")
        try:
            shown = read_until(process.stdout, lambda line: line.startswith("[0."))
            wait_until(lambda: in_second_segment(server.server.engine))
            server.stop()  # SIGTERM path: the open segment's final, then close 1001
            rest, stderr = process.communicate(timeout=20)
        finally:
            process.kill()
    assert process.returncode == mic.EXIT_STREAM_FAILED
    assert len(final_lines(shown + rest)) == 2  # the open segment was finalised by the server on its way out
    last = stderr.splitlines()[-1]
    assert last.startswith("qasr-mic: the server is shutting down (close code 1001") and "2 final(s)" in last
    assert "Traceback" not in stderr


def test_reconnect_survives_a_server_restart(tmp_path):
    write_wav(tmp_path / "talk.wav", [("silence", 0.3)] + [("speech", 0.8), ("silence", 0.8)] * 6)
    with ThreadedServer(lambda: FakeEngine(delay_s=0.005)) as first:
        port = first.port
        process = start_mic("--url", first.url, "--file", str(tmp_path / "talk.wav"), "--speed", "3",
                            "--reconnect", "20")
        try:
            shown = read_until(process.stdout, lambda line: line.startswith("[0."))
            first.stop()
            read_until(process.stderr, lambda line: "reconnecting" in line)
            with ThreadedServer(lambda: FakeEngine(delay_s=0.005), port=port):
                rest, stderr = process.communicate(timeout=30)
        finally:
            process.kill()
    assert process.returncode == 0, stderr
    finals = [parse_final_line(line) for line in final_lines(shown + rest)]
    assert len(finals) >= 4 and all(a[1] <= b[0] for a, b in zip(finals, finals[1:]))
    assert finals[-1][1] > 8  # the second server heard the end of the file, on the same timeline


def test_a_terminal_sees_the_partial_rewritten_in_place(server, tmp_path):
    write_wav(tmp_path / "talk.wav", [("silence", 0.3), ("speech", 2.5), ("silence", 0.8)])
    controller, terminal = pty.openpty()
    process = start_mic("--url", server.url, "--file", str(tmp_path / "talk.wav"), "--speed", "3",
                        stdout=terminal)
    os.close(terminal)
    screen = b""
    try:
        while True:
            ready, _, _ = select.select([controller], [], [], 20)
            if not ready:
                break
            try:
                data = os.read(controller, 4096)
            except OSError:  # the terminal closed: the process has exited
                break
            if not data:
                break
            screen += data
        process.wait(timeout=20)
    finally:
        process.kill()
        os.close(controller)
    text = screen.decode()
    assert process.returncode == 0
    assert CLEAR_LINE + "0." in text or CLEAR_LINE + "1." in text  # a partial ("0.90s") drawn on a cleared line
    assert CLEAR_LINE + "[0." in text  # the final replaces it on the same line
    assert text.rstrip("\r\n").endswith(CLEAR_LINE) or text.splitlines()[-1].startswith(("[", "\x1b"))


class StandInInputStream:
    """sounddevice.InputStream without a device: start() delivers BURST blocks at once (the consumer can only read
    them once the event loop runs again: as far behind as it gets), then presses Ctrl-C half a second later."""

    BURST = 303  # the buffer holds 30 s = 300 blocks of 100 ms: the 3 oldest are dropped

    def __init__(self, *, callback, blocksize, channels, **_):
        self.callback, self.blocksize, self.channels = callback, blocksize, channels

    def start(self):
        status = types.SimpleNamespace(input_overflow=False)
        for _ in range(self.BURST):
            self.callback(np.zeros((self.blocksize, self.channels), np.float32), self.blocksize, None, status)
        asyncio.get_running_loop().call_later(0.5, signal.raise_signal, signal.SIGINT)  # stop, cleanly

    def stop(self):
        pass

    def close(self):
        pass


def test_a_microphone_too_far_behind_drops_the_oldest_audio_with_a_warning(server, monkeypatch, capsys, caplog):
    monkeypatch.setattr(sources, "_sounddevice", lambda: stand_in_sounddevice(StandInInputStream))

    assert mic.main(["--url", server.url]) == mic.EXIT_OK
    warnings = [line for line in capsys.readouterr().err.splitlines() if "dropped" in line]
    assert warnings == ["qasr-mic: warning: the stream fell more than 30 s behind the microphone (server or network "
                        "too slow); 0.3 s of the oldest audio was dropped, unsent"]
    logged = [record for record in caplog.records if record.name == "qasr.client.sources"]
    assert len(logged) == 1 and logged[0].levelname == "WARNING" and "30 s behind" in logged[0].getMessage()
