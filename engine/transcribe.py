"""Offline transcription: whole files or arrays in, text out, through the batching engine. Also `qasr-transcribe`.

    from qasr.engine.transcribe import Transcriber
    transcriber = Transcriber.from_pretrained("Qwen/Qwen3-ASR-0.6B")
    for result in transcriber.transcribe(["a.wav", "b.flac"], language="English"):
        print(result.text)

Audio longer than `max_piece_seconds` (30 s) is cut at its quietest points (`split_long_audio`); the pieces of all
inputs are decoded together in one engine run and joined back per input: texts with a space between pieces of
space-separated scripts and nothing where either side is CJK/Thai-like (see `join_texts`), languages merged like the
official `merge_languages` ("Chinese,English"). With `words=True` (an engine with an aligner) each piece is aligned
on its own and its word times are offset to the input's time. The `qasr-transcribe` command is
engine/transcribe_cli.py.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import NamedTuple, Sequence, Union

import numpy as np

from qasr.model import audio as qaudio
from qasr.model.audio import AudioError
from qasr.model.prompt import normalize_language

from .engine import Engine, EngineOptions
from .host_copy import all_finite
from .options import OFFLINE_DECODE_RUN_AHEAD, OFFLINE_DECODE_STEPS_AHEAD
from .request import DecodeRequest, WordTime
from .transcribe_cli import DEFAULT_MODEL

AudioInput = Union[str, os.PathLike, np.ndarray, tuple]  # a path, 16 kHz float samples, or (samples, sample_rate)

MIN_PIECE_SECONDS = 0.5  # shorter pieces are zero-padded to this (the official toolkit pads its split tails so)


class Segment(NamedTuple):
    """One decoded piece of an input: [start, end) in seconds of the input's own time, and its text."""

    start: float
    end: float
    text: str


@dataclass(frozen=True)
class Transcription:
    text: str  # the pieces' texts joined (join_texts)
    language: str  # detected (or forced) languages in order, e.g. "English" or "Chinese,English"; "" for no speech
    duration: float  # seconds of audio at 16 kHz
    segments: tuple[Segment, ...]  # one per piece the audio was cut into (one for audio up to max_piece_seconds)
    words: tuple[WordTime, ...] | None = None  # asked for words: every piece's, in seconds of the input's own time
    words_reason: str | None = None  # asked for words and there are none: why (the first piece's reason)


# ---------------------------------------------------------------------------------------------------------------
# Joining pieces


def _no_space_script(char: str) -> bool:
    """Scripts written without spaces between words: CJK ideographs, kana, CJK/fullwidth punctuation, Thai & co."""
    code = ord(char)
    return (
        0x2E80 <= code <= 0x30FF  # CJK radicals, symbols and punctuation, hiragana, katakana
        or 0x3400 <= code <= 0x4DBF  # CJK extension A
        or 0x4E00 <= code <= 0x9FFF  # CJK unified ideographs
        or 0xF900 <= code <= 0xFAFF  # CJK compatibility ideographs
        or 0xFF00 <= code <= 0xFFEF  # fullwidth forms
        or 0x0E00 <= code <= 0x0EFF  # Thai, Lao
        or 0x1000 <= code <= 0x109F  # Myanmar
        or 0x1780 <= code <= 0x17FF  # Khmer
        or 0x20000 <= code <= 0x3FFFF  # CJK extensions B onwards
    )


def join_texts(texts: Sequence[str]) -> str:
    """Join the texts of consecutive pieces: nothing between them where the character on either side of the cut is
    of a script written without spaces (CJK, kana, Thai, ...), one space otherwise. Empty pieces are skipped."""
    joined = ""
    for text in texts:
        text = text.strip()
        if not text:
            continue
        if joined and not (_no_space_script(joined[-1]) or _no_space_script(text[0])):
            joined += " "
        joined += text
    return joined


def merge_languages(languages: Sequence[str]) -> str:
    """Languages of consecutive pieces as one string, like the official toolkit: in order, empty ones and
    consecutive repeats dropped, comma-separated (["Chinese", "English", "English"] -> "Chinese,English")."""
    merged: list[str] = []
    for language in languages:
        language = (language or "").strip()
        if language and (not merged or merged[-1] != language):
            merged.append(language)
    return ",".join(merged)


# ---------------------------------------------------------------------------------------------------------------
# Inputs


def load_input(item: AudioInput, name: str | None = None) -> np.ndarray:
    """One input as float32 mono samples at 16 kHz. Raises AudioError (naming the input) for anything unusable.

    item: a path (any format libsndfile reads, any rate); a 1-D float array already at 16 kHz; or (array, rate).
    name: how errors refer to an array input (paths name themselves).
    """
    if isinstance(item, (str, os.PathLike)):
        return qaudio.load_audio(item)  # its errors name the file
    name = name or "audio array"
    if isinstance(item, tuple):
        if len(item) != 2:
            raise AudioError(f"{name}: expected (samples, sample_rate), got a tuple of {len(item)} items")
        samples, rate = item
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise AudioError(f"{name}: the sample rate must be a positive integer number of Hz, got {rate!r}")
        return qaudio.resample(_checked_samples(samples, name), int(rate), qaudio.SAMPLE_RATE)
    if isinstance(item, np.ndarray):
        return _checked_samples(item, name)
    raise AudioError(f"{name}: cannot transcribe a {type(item).__name__}; pass a file path, a 1-D float numpy "
                     f"array at {qaudio.SAMPLE_RATE} Hz or a (samples, sample_rate) tuple")


def _checked_samples(samples, name: str) -> np.ndarray:
    samples = np.asarray(samples)
    if samples.ndim != 1:
        raise AudioError(f"{name}: expected 1-D mono samples, got shape {samples.shape}")
    if not np.issubdtype(samples.dtype, np.floating):
        raise AudioError(f"{name}: expected float samples in [-1, 1], got {samples.dtype} "
                         f"(convert PCM with qasr.audio.decode_pcm)")
    if samples.size == 0:
        raise AudioError(f"{name} contains no audio samples")
    if not all_finite(samples):
        raise AudioError(f"{name} contains NaN or infinite samples")
    return np.ascontiguousarray(samples, dtype=np.float32)


# ---------------------------------------------------------------------------------------------------------------
# The transcriber


class _Piece(NamedTuple):
    owner: int  # index of the input it belongs to
    start: int  # [start, end) samples in the input
    end: int
    samples: np.ndarray  # what the engine decodes (zero-padded if short)


class Transcriber:
    """Loads a model once and transcribes batches of recordings of any length with it.

    Wraps a `qasr.engine.engine.Engine`: every piece of every input in one `transcribe` call is queued at once,
    and the engine decodes up to `max_batch` of them together.
    """

    def __init__(self, engine, *, max_piece_seconds: float = qaudio.DEFAULT_MAX_SECONDS,
                 max_new_tokens: int | None = None):
        """engine: a `qasr.engine.engine.Engine` (see from_pretrained).
        max_piece_seconds: longer audio is cut into pieces of at most this length (split_long_audio).
        max_new_tokens: token limit per piece; None = the engine's budget for the piece's length.
        """
        if not 1.0 <= max_piece_seconds <= engine.options.max_audio_seconds:
            raise ValueError(f"max_piece_seconds must be between 1 and the engine's max_audio_seconds "
                             f"({engine.options.max_audio_seconds:g}), got {max_piece_seconds}")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 or None, got {max_new_tokens}")
        self.engine = engine
        self.max_piece_seconds = max_piece_seconds
        self.max_new_tokens = max_new_tokens

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto",
                        max_batch: int = 32, max_piece_seconds: float = qaudio.DEFAULT_MAX_SECONDS,
                        max_new_tokens: int | None = None, options=None, aligner: str | None = None,
                        kv_int8: bool = False, fp8_prefill: bool = False, fp8_encoder: bool = False,
                        fp8_lm_head: bool = False) -> "Transcriber":
        """Load `model` (a checkpoint directory or a Hugging Face id).

        device/dtype: "auto" = the GPU in bf16 when there is one, else the CPU in fp32.
        max_batch: pieces decoded together (the engine's slots).
        max_piece_seconds, max_new_tokens: see __init__.
        options: a full `EngineOptions` instead of the defaults derived from max_batch (max_batch is then ignored).
        aligner: a Qwen3-ForcedAligner checkpoint (directory or Hugging Face id) for `transcribe(words=True)`.
        kv_int8, fp8_prefill, fp8_encoder, fp8_lm_head: EngineOptions' (set on `options` too when given).
        Raises CheckpointError (a ValueError) when the model cannot be found or does not load.
        """
        if options is None:
            if max_batch < 1:
                raise ValueError(f"max_batch must be >= 1, got {max_batch}")
            # offline pieces belong to no stream: no KV slots are kept for prefix reuse
            options = EngineOptions(num_slots=max_batch, num_retained=0,
                                    max_audio_seconds=max(60.0, max_piece_seconds), aligner_max_batch=max_batch,
                                    decode_steps_ahead=OFFLINE_DECODE_STEPS_AHEAD,
                                    decode_run_ahead=OFFLINE_DECODE_RUN_AHEAD)
        if aligner is not None:
            options = dataclasses.replace(options, aligner=str(aligner))
        asked = {"kv_int8": kv_int8, "fp8_prefill": fp8_prefill, "fp8_encoder": fp8_encoder,
                 "fp8_lm_head": fp8_lm_head}
        options = dataclasses.replace(options, **{field: True for field, on in asked.items() if on})
        engine = Engine.from_pretrained(str(model), device=device, dtype=dtype, options=options)
        return cls(engine, max_piece_seconds=max_piece_seconds, max_new_tokens=max_new_tokens)

    def transcribe(self, audio_or_paths: Sequence[AudioInput], *, language: str | None = None, context: str = "",
                   progress: bool = False, words: bool = False) -> list[Transcription]:
        """One Transcription per input, in order.

        audio_or_paths: file paths, 1-D float arrays at 16 kHz, or (array, sample_rate) tuples (see load_input).
        language: force the output language (e.g. "English", any case); None lets the model detect it per piece.
        context: text for the system prompt (names, terms, the topic), the same for every input.
        progress: show a tqdm bar on stderr, in seconds of audio decoded.
        words: word times too (the engine needs an aligner: Transcriber.from_pretrained(aligner=...)).
        Raises AudioError naming the first input that cannot be used (missing, unreadable, empty, NaN), before any
        decoding; UnsupportedLanguageError for an unknown language.
        """
        if isinstance(audio_or_paths, (str, os.PathLike, np.ndarray, tuple)):
            raise TypeError("transcribe takes a list of inputs; wrap a single one in a list")
        clips = [load_input(item, name=f"input {i}") for i, item in enumerate(audio_or_paths)]
        return self.transcribe_clips(clips, language=language, context=context, progress=progress, words=words)

    def transcribe_clips(self, clips: Sequence[np.ndarray], *, language: str | None = None, context: str = "",
                         progress=False, words: bool = False) -> list[Transcription]:
        """Like `transcribe`, for clips already loaded by `load_input`.

        progress: a bool, or a tqdm-like object whose `update(seconds)` is called as pieces finish (the CLI's one
        bar over many calls).
        """
        language = normalize_language(language) if language is not None and str(language).strip() else None
        if words and self.engine.aligner is None:
            raise ValueError("word times need a forced aligner: load one with Transcriber.from_pretrained(aligner=...)")
        pieces = [piece for i, clip in enumerate(clips) for piece in self._pieces(i, clip)]
        results: list = [None] * len(pieces)
        bar, own_bar = progress_bar(progress, total=sum(len(c) for c in clips) / qaudio.SAMPLE_RATE)

        def finished(k: int, result) -> None:
            results[k] = result
            if bar is not None:
                bar.update((pieces[k].end - pieces[k].start) / qaudio.SAMPLE_RATE)

        try:
            for k, piece in enumerate(pieces):
                request = DecodeRequest(audio=piece.samples, context=context, language=language,
                                        max_new_tokens=self.max_new_tokens, words=words)
                self.engine.add(request, lambda result, k=k: finished(k, result))
            self.engine.run_until_done()
        except BaseException as error:  # e.g. Ctrl-C: leave the engine empty for the next call
            self.engine.fail_all(error)
            raise
        finally:
            if own_bar:
                bar.close()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [self._assemble(i, clip, pieces, results, words) for i, clip in enumerate(clips)]

    def _pieces(self, owner: int, clip: np.ndarray) -> list[_Piece]:
        ranges = qaudio.split_long_audio(clip, max_seconds=self.max_piece_seconds)
        min_samples = int(MIN_PIECE_SECONDS * qaudio.SAMPLE_RATE)
        pieces = []
        for start, end in ranges:
            samples = clip[start:end]
            # a split tail can be a few samples; a whole clip shorter than one mel frame cannot be encoded at all
            if len(samples) < min_samples and (len(ranges) > 1 or len(samples) < qaudio.HOP_LENGTH):
                samples = np.pad(samples, (0, min_samples - len(samples)))
            pieces.append(_Piece(owner, start, end, np.ascontiguousarray(samples, dtype=np.float32)))
        return pieces

    @staticmethod
    def _assemble(owner: int, clip: np.ndarray, pieces: list[_Piece], results: list, words: bool) -> Transcription:
        mine = [(piece, result) for piece, result in zip(pieces, results) if piece.owner == owner]
        rate = qaudio.SAMPLE_RATE
        segments = tuple(Segment(p.start / rate, p.end / rate, r.text) for p, r in mine)
        timed, reason = _file_words(mine) if words else (None, None)
        return Transcription(
            text=join_texts([s.text for s in segments]),
            language=merge_languages([r.language for _, r in mine]),
            duration=len(clip) / rate,
            segments=segments,
            words=timed,
            words_reason=reason,
        )


def _file_words(pieces_and_results) -> tuple[tuple[WordTime, ...], str | None]:
    """Each piece's word times offset by the piece's start and kept inside it (a short piece is zero-padded: nothing
    was said in the padding); the first reason when no piece has words."""
    rate = qaudio.SAMPLE_RATE
    timed, reasons = [], []
    for piece, result in pieces_and_results:
        start, end = piece.start / rate, piece.end / rate

        def at(seconds: float) -> float:
            return min(round(start + seconds, 3), end)

        timed += [WordTime(word, at(s), at(e)) for word, s, e in result.words or ()]
        if result.words_reason:
            reasons.append(result.words_reason)
    return tuple(timed), (reasons[0] if not timed and reasons else None)


def progress_bar(progress, total: float):
    """(bar or None, whether we own it and must close it)."""
    if progress is None or progress is False:
        return None, False
    if progress is True:
        from tqdm import tqdm

        layout = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s audio [{elapsed}<{remaining}]"
        return tqdm(total=round(total, 2), unit="s", desc="transcribing", file=sys.stderr, bar_format=layout), True
    return progress, False
