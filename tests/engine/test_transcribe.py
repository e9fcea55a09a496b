"""qasr.engine.transcribe: the Transcriber API and the qasr-transcribe CLI, on the tiny random checkpoint.

The random model's transcripts are meaningless, so the tests check what the API promises about them: one result per
input in order, the same text the engine gives for that audio, long audio cut into pieces that cover it, joined
texts and merged languages, clear errors, and the CLI's output formats and exit codes.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

from fakes import speech_like  # tests/ is on sys.path (conftest)
from qasr.model import audio as qaudio
from qasr.model.audio import AudioError
from qasr.model.prompt import UnsupportedLanguageError
from qasr.engine import transcribe_cli
from qasr.engine.transcribe import Segment, Transcriber, Transcription, join_texts, merge_languages
from qasr.engine.transcribe_cli import main
from qasr.engine.request import DecodeRequest

SR = qaudio.SAMPLE_RATE
MAX_NEW_TOKENS = 12
LONG_PATTERN = [("speech", 6.0), ("silence", 1.0)] * 10  # 70 s: 6 s bursts between 1 s pauses


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    audio, _ = speech_like([("speech", seconds)], seed=seed)
    return audio


@pytest.fixture(scope="module")
def transcriber(tiny_model_dir) -> Transcriber:
    # the random model rarely says EOS: a small token limit keeps every decode short
    return Transcriber.from_pretrained(tiny_model_dir, device="cpu", dtype="float32", max_batch=8,
                                       max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def long_clip() -> tuple[np.ndarray, list[tuple[float, float]]]:
    return speech_like(LONG_PATTERN, seed=7)


@pytest.fixture(scope="module")
def audio_files(tmp_path_factory, long_clip) -> dict[str, Path]:
    """a.wav (3 s, 16 kHz), b.flac (2 s, 44.1 kHz stereo), long.wav (70 s), garbage.wav (not audio)."""
    folder = tmp_path_factory.mktemp("audio")
    files = {name: folder / name for name in ("a.wav", "b.flac", "long.wav", "garbage.wav")}
    soundfile.write(str(files["a.wav"]), speech(3.0, seed=1), SR)
    stereo = np.stack([speech(2.0, seed=2), speech(2.0, seed=3)], axis=1)
    soundfile.write(str(files["b.flac"]), qaudio.resample(stereo, SR, 44100), 44100)
    soundfile.write(str(files["long.wav"]), long_clip[0], SR)
    files["garbage.wav"].write_bytes(b"this is not a wav file" * 10)
    return files


def engine_text(transcriber: Transcriber, samples: np.ndarray) -> str:
    request = DecodeRequest(audio=np.ascontiguousarray(samples, dtype=np.float32), max_new_tokens=MAX_NEW_TOKENS)
    (result,) = transcriber.engine.transcribe([request])
    return result.text


# ---------------------------------------------------------------------------------------------------------------
# The API


def test_paths_arrays_and_rate_tuples_in_input_order(transcriber, audio_files):
    clip = speech(1.5, seed=4)
    at_8k = qaudio.resample(clip, SR, 8000)
    results = transcriber.transcribe([audio_files["a.wav"], clip, (at_8k, 8000), str(audio_files["b.flac"])])
    assert [type(r) for r in results] == [Transcription] * 4
    assert [r.duration for r in results] == pytest.approx([3.0, 1.5, 1.5, 2.0], abs=1e-3)
    expected_audio = [qaudio.load_audio(audio_files["a.wav"]), clip, qaudio.resample(at_8k, 8000, SR),
                      qaudio.load_audio(audio_files["b.flac"])]
    for result, samples in zip(results, expected_audio):
        assert result.text == engine_text(transcriber, samples)  # short audio: one piece, decoded as it is
        assert result.segments == (Segment(0.0, result.duration, result.text),)


def test_file_transcription_queues_the_offline_number_of_steps_beside_an_admission(transcriber):
    from qasr.engine.options import OFFLINE_DECODE_STEPS_AHEAD, EngineOptions

    assert transcriber.engine.options.decode_steps_ahead == OFFLINE_DECODE_STEPS_AHEAD
    assert OFFLINE_DECODE_STEPS_AHEAD > EngineOptions().decode_steps_ahead  # live serving keeps its own


def test_long_audio_is_split_at_pauses_and_joined(transcriber, long_clip):
    samples, bursts = long_clip
    (result,) = transcriber.transcribe([samples])
    segments = result.segments
    assert len(segments) >= 3
    assert segments[0].start == 0.0 and segments[-1].end == pytest.approx(70.0)
    assert all(a.end == b.start for a, b in zip(segments, segments[1:]))  # no gaps, no overlaps
    assert all(0 < s.end - s.start <= transcriber.max_piece_seconds for s in segments)
    for cut in (s.start for s in segments[1:]):  # every cut lands in a pause, not inside a burst
        assert not any(start < cut < end for start, end in bursts), cut
    # every piece is decoded on its own, and the pieces' texts and languages are joined
    for segment in segments:
        piece = samples[round(segment.start * SR) : round(segment.end * SR)]
        assert segment.text == engine_text(transcriber, piece)
    assert result.text == join_texts([s.text for s in segments])
    assert result.duration == pytest.approx(70.0)


def test_forced_language_and_context(transcriber):
    clip = speech(2.0, seed=5)
    (forced,) = transcriber.transcribe([clip], language="english", context="Names: Qwen, qasr.")
    assert forced.language == "English"
    expected = transcriber.engine.transcribe(
        [DecodeRequest(audio=clip, language="English", context="Names: Qwen, qasr.", max_new_tokens=MAX_NEW_TOKENS)])[0]
    assert forced.text == expected.text
    with pytest.raises(UnsupportedLanguageError, match="Klingon"):
        transcriber.transcribe([clip], language="Klingon")


def test_silence_and_very_short_audio_give_results(transcriber):
    silence, blip = np.zeros(2 * SR, dtype=np.float32), speech(0.005)  # 80 samples: less than one mel frame
    results = transcriber.transcribe([silence, blip])
    assert [r.duration for r in results] == pytest.approx([2.0, 0.005])
    assert all(isinstance(r.text, str) and len(r.segments) == 1 for r in results)
    assert results[1].segments[0].end == pytest.approx(0.005)


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.array([0.1, np.nan, 0.2] * 1000, dtype=np.float32), r"input 1 contains NaN"),
        (np.zeros(0, dtype=np.float32), r"input 1 contains no audio"),
        (np.zeros((SR, 2), dtype=np.float32), r"input 1: expected 1-D"),
        (np.zeros(SR, dtype=np.int16), r"input 1: expected float samples"),
        ((np.zeros(SR, dtype=np.float32), 0), r"input 1: the sample rate must be a positive"),
        ([0.0] * SR, r"input 1: cannot transcribe a list"),
    ],
)
def test_bad_inputs_are_refused_before_decoding(transcriber, bad, message):
    steps = transcriber.engine.steps
    with pytest.raises(AudioError, match=message):
        transcriber.transcribe([speech(1.0), bad])
    assert transcriber.engine.steps == steps  # nothing was decoded


def test_bad_files_are_named(transcriber, audio_files, tmp_path):
    missing = tmp_path / "missing.wav"
    with pytest.raises(AudioError, match="not found.*missing.wav"):
        transcriber.transcribe([audio_files["a.wav"], missing])
    with pytest.raises(AudioError, match="garbage.wav"):
        transcriber.transcribe([audio_files["garbage.wav"]])
    empty = tmp_path / "empty.wav"
    soundfile.write(str(empty), np.zeros(0, dtype=np.float32), SR)
    with pytest.raises(AudioError, match="empty.wav contains no audio"):
        transcriber.transcribe([empty])
    with pytest.raises(TypeError, match="list"):
        transcriber.transcribe(str(audio_files["a.wav"]))


def test_progress_bar_on_request(transcriber, capsys):
    transcriber.transcribe([speech(2.0), speech(1.0)], progress=True)
    err = capsys.readouterr().err
    assert "transcribing" in err and "100%" in err and "3/3 s audio" in err
    transcriber.transcribe([speech(1.0)])
    assert capsys.readouterr().err == ""


def test_join_texts_spaces_only_between_space_separated_scripts():
    assert join_texts(["Hello there.", "  General Kenobi. "]) == "Hello there. General Kenobi."
    assert join_texts(["你好。", "世界"]) == "你好。世界"
    mixed = ["我们用 qasr", "transcribe it", "然后", "结束"]
    assert join_texts(mixed) == "我们用 qasr transcribe it然后结束"
    assert join_texts(["こんにちは", "世界"]) == "こんにちは世界"
    assert join_texts(["", "one", "   ", "two"]) == "one two"
    assert join_texts([]) == ""


def test_merge_languages_like_the_official_toolkit():
    cases = [["Chinese", "English", "English"], ["", "English", "", "English"], [], ["", ""],
             ["English", "Chinese", "English"], [" French ", "French"]]
    expected = ["Chinese,English", "English", "", "", "English,Chinese,English", "French"]
    assert [merge_languages(c) for c in cases] == expected
    try:
        import official

        official.import_official()
        from qwen_asr.inference.utils import merge_languages as official_merge
    except ImportError:
        return
    assert [official_merge(c) for c in cases] == expected


# ---------------------------------------------------------------------------------------------------------------
# The CLI


def cli(*args: str) -> int:
    return main([*args, "--device", "cpu", "--batch-size", "8", "--max-new-tokens", str(MAX_NEW_TOKENS)])


def test_cli_prints_file_and_text_per_file(tiny_model_dir, audio_files, transcriber, capsys):
    files = [str(audio_files["a.wav"]), str(audio_files["b.flac"])]
    assert cli(*files, "--model", str(tiny_model_dir)) == 0
    out, err = capsys.readouterr()
    expected = transcriber.transcribe(files)
    assert out.splitlines() == [f"{f}: {r.text}" for f, r in zip(files, expected)]
    assert "transcribing" not in err  # stderr is not a terminal here: no bar unless asked


def test_cli_freezes_the_loaded_heap_while_it_transcribes_and_thaws_it(tiny_model_dir, audio_files, monkeypatch,
                                                                       capsys):
    # a full collection walks every object the loaded engine holds, with nothing on the GPU meanwhile
    seen = []
    transcribe_files = transcribe_cli._transcribe_files

    def watched(*args):
        seen.append(gc.get_freeze_count())
        return transcribe_files(*args)

    monkeypatch.setattr(transcribe_cli, "_transcribe_files", watched)
    assert gc.get_freeze_count() == 0
    assert cli(str(audio_files["a.wav"]), "--model", str(tiny_model_dir)) == 0
    assert seen and seen[0] > 10_000  # the model's modules, tensors and tokenizer among them
    assert gc.get_freeze_count() == 0  # given back: left frozen they are never freed
    assert capsys.readouterr().out.startswith(str(audio_files["a.wav"]))


def test_cli_json_with_a_long_file(tiny_model_dir, audio_files, capsys):
    files = [str(audio_files["long.wav"]), str(audio_files["a.wav"])]
    assert cli(*files, "--model", str(tiny_model_dir), "--json", "--language", "English", "--progress") == 0
    out, err = capsys.readouterr()
    objects = [json.loads(line) for line in out.splitlines()]
    assert [o["file"] for o in objects] == files
    assert all(set(o) == {"file", "text", "language", "duration", "segments"} for o in objects)
    assert all(o["language"] == "English" for o in objects)
    long = objects[0]
    assert long["duration"] == pytest.approx(70.0) and len(long["segments"]) >= 3
    assert long["segments"][0]["start"] == 0.0 and long["segments"][-1]["end"] == pytest.approx(70.0)
    assert long["text"] == join_texts([s["text"] for s in long["segments"]])
    assert "transcribing" in err and "73/73 s audio" in err  # --progress: the bar counts the audio of all files


def test_cli_progress_bar_by_default_only_on_a_terminal_for_long_or_many_files(tiny_model_dir, audio_files, capsys,
                                                                                 monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert cli(str(audio_files["a.wav"]), "--model", str(tiny_model_dir)) == 0
    assert "transcribing" not in capsys.readouterr().err  # one short file: no bar
    assert cli(str(audio_files["long.wav"]), "--model", str(tiny_model_dir)) == 0
    assert "transcribing" in capsys.readouterr().err
    assert cli(str(audio_files["long.wav"]), "--model", str(tiny_model_dir), "--no-progress") == 0
    assert "transcribing" not in capsys.readouterr().err


def test_cli_reports_bad_files_and_goes_on(tiny_model_dir, audio_files, tmp_path, capsys):
    missing = str(tmp_path / "nope.wav")
    files = [str(audio_files["a.wav"]), missing, str(audio_files["garbage.wav"]), str(audio_files["b.flac"])]
    assert cli(*files, "--model", str(tiny_model_dir)) == 1
    out, err = capsys.readouterr()
    assert [line.split(": ")[0] for line in out.splitlines()] == [files[0], files[3]]
    errors = err.strip().splitlines()
    assert errors[0] == f"qasr-transcribe: error: audio file not found: {missing}"
    assert errors[1].startswith("qasr-transcribe: error: cannot decode audio from") and "garbage.wav" in errors[1]
    assert errors[2] == "qasr-transcribe: 2 of 4 file(s) failed"
    assert "Traceback" not in err


def test_cli_kv_int8_transcribes_from_an_int8_cache(tiny_model_dir, audio_files, monkeypatch, capsys):
    built = []
    from_pretrained = Transcriber.from_pretrained.__func__
    monkeypatch.setattr(Transcriber, "from_pretrained", classmethod(
        lambda cls, *a, **k: built.append(from_pretrained(cls, *a, **k)) or built[-1]))
    file = str(audio_files["a.wav"])
    assert cli(file, "--model", str(tiny_model_dir), "--kv-int8") == 0
    engine = built[0].engine
    assert engine.options.kv_int8 and engine.runner.cache.int8 and not engine.options.fp8_prefill
    out = capsys.readouterr().out
    assert out.startswith(f"{file}: ") and len(out.split(": ", 1)[1].strip()) > 0


@pytest.mark.parametrize("flag, products", [("--fp8-prefill", "FP8 prefill"), ("--fp8-encoder", "FP8 encoder"),
                                            ("--fp8-lm-head", "FP8 lm_head weights")])
def test_cli_fp8_where_it_cannot_run_is_one_line(tiny_model_dir, audio_files, capsys, flag, products):
    # the CPU: no fused kernels here, and FP8 products need them
    assert cli(str(audio_files["a.wav"]), "--model", str(tiny_model_dir), "--device", "cpu", flag) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("qasr-transcribe: error: cannot load model") and products in err


def test_cli_missing_model_is_one_line(tmp_path, audio_files, capsys):
    assert cli(str(audio_files["a.wav"]), "--model", str(tmp_path / "no-such-model")) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("qasr-transcribe: error: cannot load model")
    assert "no-such-model" in err


def test_cli_hub_id_offline_is_one_line_that_says_how_to_get_it(tmp_path, audio_files, capsys, monkeypatch):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)  # read at import time: patch the copy too
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert cli(str(audio_files["a.wav"]), "--model", "Qwen/Qwen3-ASR-0.6B") == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "hf download Qwen/Qwen3-ASR-0.6B" in err
    assert "Traceback" not in err


def test_cli_only_missing_files_skips_loading_the_model(tmp_path, capsys):
    assert cli(str(tmp_path / "a.wav"), "--model", str(tmp_path / "no-such-model")) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"qasr-transcribe: error: audio file not found: {tmp_path / 'a.wav'}"


def test_cli_refuses_an_unknown_language_before_loading(tiny_model_dir, audio_files, capsys):
    assert cli(str(audio_files["a.wav"]), "--model", str(tiny_model_dir), "--language", "Elvish") == 1
    assert "unsupported language 'Elvish'" in capsys.readouterr().err


def test_console_script(tiny_model_dir, audio_files, tmp_path):
    script = Path(sys.executable).parent / "qasr-transcribe"
    if not script.exists():
        pytest.skip("the qasr-transcribe console script is not installed next to this python")
    missing = str(tmp_path / "gone.flac")
    run = subprocess.run(
        [str(script), str(audio_files["a.wav"]), missing, "--model", str(tiny_model_dir), "--device", "cpu", "--json",
         "--max-new-tokens", str(MAX_NEW_TOKENS)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 1
    good, bad = (json.loads(line) for line in run.stdout.splitlines())
    assert good["file"] == str(audio_files["a.wav"]) and good["duration"] == pytest.approx(3.0)
    assert bad == {"file": missing, "error": f"audio file not found: {missing}"}
    assert "Traceback" not in run.stderr and f"audio file not found: {missing}" in run.stderr


def test_console_script_stops_quietly_when_its_reader_leaves(tiny_model_dir, audio_files):
    """`qasr-transcribe *.wav | head -1`: stdout's pipe closed by its reader is exit 141 (as a shell reports a tool
    that SIGPIPE stopped), with nothing on stderr (no traceback)."""
    script = Path(sys.executable).parent / "qasr-transcribe"
    if not script.exists():
        pytest.skip("the qasr-transcribe console script is not installed next to this python")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has left before the first line: its write fails whatever the timing
    try:
        run = subprocess.run([str(script), str(audio_files["a.wav"]), str(audio_files["a.wav"]), "--model",
                              str(tiny_model_dir), "--device", "cpu", "--max-new-tokens", str(MAX_NEW_TOKENS)],
                             stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    finally:
        os.close(write_end)
    assert run.returncode == 141, run.stderr
    assert run.stderr == ""
