"""Word times offline (#17): `Transcriber.transcribe(words=True)` and `qasr-transcribe --words` on the tiny model and a
tiny random aligner. A long file is cut into pieces; each piece is aligned on its own and its times are offset to
the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile

from fakes import speech_like  # tests/ is on sys.path (conftest)
from qasr.engine.request import DecodeRequest
from qasr.engine.transcribe import Transcriber
from qasr.engine.transcribe_cli import main

SR = 16000
MAX_NEW_TOKENS = 8
LONG_PATTERN = [("speech", 6.0), ("silence", 1.0)] * 7  # 49 s: at least two pieces


@pytest.fixture(scope="module")
def transcriber(tiny_model_dir, tiny_aligner_dir) -> Transcriber:
    return Transcriber.from_pretrained(tiny_model_dir, device="cpu", dtype="float32", max_batch=4,
                                       max_new_tokens=MAX_NEW_TOKENS, aligner=tiny_aligner_dir)


@pytest.fixture(scope="module")
def long_file(tmp_path_factory):
    audio, _ = speech_like(LONG_PATTERN, seed=11)
    path = tmp_path_factory.mktemp("words") / "long.wav"
    soundfile.write(str(path), audio, SR)
    return path, audio


def test_long_audio_is_aligned_per_piece_with_times_offset_to_the_file(transcriber, long_file):
    _, audio = long_file
    (result,) = transcriber.transcribe([audio], language="English", words=True)
    assert len(result.segments) >= 2 and result.words and result.words_reason is None
    expected = []
    for segment in result.segments:  # each piece alone, through the engine: its own clip-relative times
        piece = np.ascontiguousarray(audio[round(segment.start * SR):round(segment.end * SR)])
        (alone,) = transcriber.engine.transcribe([DecodeRequest(audio=piece, language="English",
                                                                max_new_tokens=MAX_NEW_TOKENS, words=True)])
        expected += [(w.word, min(round(segment.start + w.start, 3), segment.end),
                      min(round(segment.start + w.end, 3), segment.end)) for w in alone.words]
    assert [tuple(w) for w in result.words] == expected
    assert any(w.start >= result.segments[1].start for w in result.words)  # later pieces are in file time
    for segment in result.segments:
        inside = [w for w in result.words if segment.start <= w.start < segment.end]
        assert all(w.end <= segment.end for w in inside)


def test_words_are_asked_for_only_when_wanted_and_need_an_aligner(transcriber, tiny_model_dir, long_file):
    _, audio = long_file
    (plain,) = transcriber.transcribe([audio[: 3 * SR]], language="English")
    assert plain.words is None and plain.words_reason is None
    without = Transcriber.from_pretrained(tiny_model_dir, device="cpu", dtype="float32", max_batch=2,
                                          max_new_tokens=MAX_NEW_TOKENS)
    with pytest.raises(ValueError, match="aligner"):
        without.transcribe([audio[: 3 * SR]], words=True)


def test_cli_words_in_json_and_text(tiny_model_dir, tiny_aligner_dir, long_file, capsys):
    path, audio = long_file
    common = [str(path), "--model", str(tiny_model_dir), "--aligner", str(tiny_aligner_dir), "--device", "cpu",
              "--language", "English", "--max-new-tokens", str(MAX_NEW_TOKENS), "--batch-size", "4", "--words"]
    assert main([*common, "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = json.loads(line)
    words = result["words"]
    assert words and all(0 <= w["start"] <= w["end"] <= result["duration"] for w in words)
    assert words[-1]["start"] >= result["segments"][1]["start"]
    assert main(common) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{path}: ")
    assert lines[1:] == [f"  {w['start']:.3f}-{w['end']:.3f} {w['word']}" for w in words]


def test_cli_words_without_an_aligner_is_one_line(tiny_model_dir, long_file, capsys):
    assert main([str(long_file[0]), "--model", str(tiny_model_dir), "--words"]) == 1
    assert "--words needs --aligner" in capsys.readouterr().err
