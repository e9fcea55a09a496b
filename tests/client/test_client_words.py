"""Word times in qasr.client and qasr-mic (#17): against a live `qasr-server --aligner` (the tiny model and a tiny
random aligner on the CPU, its own process) a stream with `words=True` gets finals whose `Word`s are the aligner's
units inside the segment, in order, and qasr-mic --words prints them (`word@start`) and --jsonl carries them;
against a server without an aligner the stream is refused with 1003 and qasr-mic says what to do; after a reconnect
word times continue the client's timeline like every other time."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import soundfile

from qasr.client import Final, Ready, StreamClosed, Word, file_source, mic, stream_audio
from qasr.client.stream import _Timeline
from qasr.model.aligner_words import split_words

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine, speech_like
from live_server import ThreadedServer

BURSTS = [("silence", 0.4), ("speech", 1.4), ("silence", 0.9), ("speech", 1.1), ("silence", 0.9)]


@pytest.fixture
def aligner_url(aligner_server_port):
    """ws:// of the session's qasr-server --aligner (conftest.aligner_server_port)."""
    return f"ws://127.0.0.1:{aligner_server_port}/v1/stream"


@pytest.fixture(scope="module")
def talk_wav(tmp_path_factory):
    path = tmp_path_factory.mktemp("words") / "talk.wav"
    audio, _ = speech_like(BURSTS, seed=3)
    soundfile.write(str(path), audio, 16000, subtype="PCM_16")
    return path


def collect(url: str, wav, **options) -> list:
    async def main():
        return [event async for event in stream_audio(url, file_source(wav, realtime=False), language="English",
                                                      **options)]

    return asyncio.run(asyncio.wait_for(main(), 120))


def assert_words_inside(final: Final) -> None:
    if not final.words:
        assert final.words == () and final.words_reason, final
        return
    assert final.words_reason is None
    assert all(isinstance(word, Word) for word in final.words)
    assert [word.word for word in final.words] == split_words(final.text, "English")  # the aligner's units
    assert all(final.start <= word.start <= word.end <= final.end for word in final.words)
    assert all(a.start <= b.start and a.end <= b.end for a, b in zip(final.words, final.words[1:]))


def test_a_stream_with_words_gets_the_aligners_word_times_on_every_final(aligner_url, talk_wav):
    events = collect(aligner_url, talk_wav, words=True)
    ready, finals = events[0], [event for event in events if isinstance(event, Final)]
    assert isinstance(ready, Ready) and ready.limits["words"] is True and ready.config["words"] is True
    assert len(finals) == 2 and any(final.words for final in finals), finals
    for final in finals:
        assert_words_inside(final)

    plain = [event for event in collect(aligner_url, talk_wav) if isinstance(event, Final)]
    assert len(plain) == 2 and all(final.words is None and final.words_reason is None for final in plain)


def test_qasr_mic_words_prints_each_words_start_and_jsonl_carries_the_words(aligner_url, talk_wav, capsys):
    argv = ["--url", aligner_url, "--file", str(talk_wav), "--speed", "8", "--language", "English", "--words"]
    assert mic.main(argv) == mic.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    finals = [i for i, line in enumerate(lines) if line.startswith("[")]
    assert len(finals) == 2 and len(lines) == 4  # each final's line, then its word line
    for i in finals:
        start, end, text = re.fullmatch(r"\[([\d.]+)-([\d.]+)\] (.*)", lines[i]).groups()
        words = lines[i + 1]
        assert words.startswith("    ")
        if words.strip().startswith("(no word times: "):
            continue
        shown = [re.fullmatch(r"(.+)@([\d.]+)", item).groups() for item in words.split()]
        assert [word for word, _ in shown] == split_words(text, "English")
        assert all(float(start) - 0.01 <= float(at) <= float(end) + 0.01 for _, at in shown)

    assert mic.main([*argv, "--jsonl", "--no-partials"]) == mic.EXIT_OK
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 2 and any(record["words"] for record in records)
    for record in records:
        final = Final(record["segment_id"], record["text"], record["language"], record["start"], record["end"],
                      record["reason"], record["latency_ms"],
                      words=tuple(Word(**word) for word in record["words"]), words_reason=record.get("words_reason"))
        assert_words_inside(final)


def test_words_from_a_server_without_an_aligner_are_refused_and_qasr_mic_says_why(talk_wav, capsys):
    with ThreadedServer(lambda: FakeEngine(delay_s=0.005)) as server:
        with pytest.raises(StreamClosed) as refused:
            collect(server.url, talk_wav, words=True)
        code = mic.main(["--url", server.url, "--file", str(talk_wav), "--speed", "8", "--words"])
    assert refused.value.code == 1003 and "no aligner" in str(refused.value)
    stderr = capsys.readouterr().err
    assert code == mic.EXIT_STREAM_FAILED and stderr.count("\n") == 1  # refused before `ready`: one line
    assert "no aligner" in stderr and "--words needs a server started with --aligner" in stderr


def test_word_times_continue_the_timeline_after_a_reconnect():
    timeline = _Timeline()
    timeline.offset_s, timeline.segment_offset = 10.0, 3  # what the earlier connections covered
    final = Final(0, "hi there", "English", 0.5, 1.5, "silence", 5.0, words=(Word("hi", 0.6, 0.9),
                                                                              Word("there", 1.0, 1.4)))
    shifted = timeline.shift(final)
    assert (shifted.segment_id, shifted.start, shifted.end) == (3, 10.5, 11.5)
    assert shifted.words == (Word("hi", 10.6, 10.9), Word("there", 11.0, 11.4))
    empty = timeline.shift(Final(1, "", "", 2.0, 3.0, "silence", 5.0, words=(), words_reason="no words"))
    assert empty.words == () and empty.words_reason == "no words"
