"""The units the forced aligner times: a transcript split into words the way the official aligner splits it.

The official `Qwen3ForceAlignProcessor.encode_timestamp` (qwen-asr 0.0.6) lowercases the language and then:
- "japanese": the words of `nagisa.tagging(text)` (an RNN tokenizer), each cleaned;
- "korean": soynlp's `LTokenizer` over the raw text, scoring 1.0 every word of the Korean dictionary it ships, each
  part cleaned. That rule is small and soynlp is GPL, so qasr has its own `split_korean` over the same words
  (aligner_ko_words.txt); the tests check it against soynlp;
- anything else: the text split on whitespace, each piece cleaned, then every CJK ideograph made a unit of its own
  (the runs of other characters between them stay whole) - so Chinese and Cantonese come out one unit per character.
Cleaning keeps letters (Unicode L*), numbers (N*) and the apostrophe; a unit left empty is dropped, so punctuation
never becomes a unit.

nagisa is an optional dependency (`pip install 'qasr[ja]'`; the official pins 0.2.11): without it Japanese text
cannot be split and `split_words` raises `SplitterUnavailable`, which the aligner turns into a reason.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import unicodedata
from pathlib import Path

KOREAN_WORDS_FILE = Path(__file__).with_name("aligner_ko_words.txt")

# CJK ideograph blocks that become one unit per character (the official list: unified, extensions A-E, compatibility)
CJK_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF), (0xF900, 0xFAFF),
)  # fmt: skip


class SplitterUnavailable(RuntimeError):
    """The language's word splitter needs a package that is not installed."""


def split_words(text: str, language: str) -> list[str]:
    """The aligner's units of `text` in `language` (a language name, any case), in order."""
    language = language.strip().lower()
    if language == "japanese":
        return split_japanese(text)
    if language == "korean":
        return split_korean(text)
    return split_spaced(text)


def split_spaced(text: str) -> list[str]:
    """Whitespace-separated words, cleaned, with every CJK ideograph a unit of its own."""
    units: list[str] = []
    for piece in text.split():
        cleaned = clean(piece)
        if cleaned:
            units.extend(_split_ideographs(cleaned))
    return units


def split_korean(text: str) -> list[str]:
    """Each whitespace token cut after its longest known word prefix (soynlp's LTokenizer rule), parts cleaned.

    A token of at most two characters stays whole; otherwise its longest prefix of two or more characters (the
    whole token included) that is a known word is split off from the rest; a token with no known prefix stays
    whole. The lookup sees the raw token, punctuation included; cleaning comes after, as in the official code.
    """
    words = _korean_words()
    units: list[str] = []
    for token in text.split():
        parts = [token]
        if len(token) > 2:
            cut = next((end for end in range(len(token), 1, -1) if token[:end] in words), None)
            if cut is not None:
                parts = [token[:cut], token[cut:]]
        units.extend(cleaned for cleaned in map(clean, parts) if cleaned)
    return units


def split_japanese(text: str) -> list[str]:
    """nagisa's words, cleaned (SplitterUnavailable without nagisa)."""
    nagisa = _nagisa()
    return [cleaned for cleaned in map(clean, nagisa.tagging(text).words) if cleaned]


def japanese_available() -> bool:
    """Whether nagisa can be imported (without importing it: that loads its model, a few seconds)."""
    return importlib.util.find_spec("nagisa") is not None


def clean(token: str) -> str:
    """`token` without the characters the aligner ignores: keeps letters, numbers and the apostrophe."""
    if token.isascii():  # the common case, without a category lookup per character (the engine splits every final)
        return token.translate(_ASCII_IGNORED)
    return "".join(ch for ch in token if ch == "'" or unicodedata.category(ch)[0] in "LN")


# ASCII's letters and numbers (Unicode L* and N*) are exactly [A-Za-z0-9]
_ASCII_IGNORED = {code: None for code in range(128) if not (chr(code).isalnum() or chr(code) == "'")}


def is_cjk(ch: str) -> bool:
    code = ord(ch)
    return any(low <= code <= high for low, high in CJK_RANGES)


def _split_ideographs(segment: str) -> list[str]:
    if segment.isascii():  # no ideograph below U+3400
        return [segment]
    units, run = [], ""
    for ch in segment:
        if is_cjk(ch):
            if run:
                units.append(run)
                run = ""
            units.append(ch)
        else:
            run += ch
    if run:
        units.append(run)
    return units


@functools.cache
def _korean_words() -> frozenset[str]:
    lines = KOREAN_WORDS_FILE.read_text(encoding="utf-8").splitlines()
    return frozenset(line for line in lines if line and not line.startswith("# "))


@functools.cache
def _nagisa():
    if not japanese_available():
        raise SplitterUnavailable(
            "Japanese word splitting needs the nagisa package, which is not installed (pip install 'qasr[ja]')"
        )
    return importlib.import_module("nagisa")
