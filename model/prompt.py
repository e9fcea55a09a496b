"""The text side of Qwen3-ASR: the prompt the decoder reads and the way its output is read back.

Prompt (what the official processor renders from the checkpoint's chat template, with the audio expanded):

    <|im_start|>system\\n{context}<|im_end|>\\n<|im_start|>user\\n<|audio_start|>
        <|audio_pad|> x num_audio_tokens
    <|audio_end|><|im_end|>\\n<|im_start|>assistant\\n[language English<asr_text>][answer prefix]

The decoder answers `language X<asr_text>TEXT` then EOS (only `TEXT` when the language was forced in the prompt);
`language None<asr_text>` means it heard no speech. Audio embeddings replace the <|audio_pad|> positions.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .tokenizer import ASR_TEXT, IM_END, IM_START, Tokenizer

# The languages Qwen3-ASR can be told to transcribe in, spelled as the model writes them (official list and order).
SUPPORTED_LANGUAGES: tuple[str, ...] = (
    "Chinese", "English", "Cantonese", "Arabic", "German", "French", "Spanish", "Portuguese", "Indonesian",
    "Italian", "Korean", "Russian", "Thai", "Vietnamese", "Japanese", "Turkish", "Hindi", "Malay", "Dutch",
    "Swedish", "Danish", "Finnish", "Polish", "Czech", "Filipino", "Persian", "Greek", "Romanian", "Hungarian",
    "Macedonian",
)  # fmt: skip

LANGUAGE_TAG = "language "  # the output starts "language X<asr_text>"
REPETITION_THRESHOLD = 20  # the official output guard: runs this long collapse to one copy


class UnsupportedLanguageError(ValueError):
    """A forced language that Qwen3-ASR does not know."""


def _canonical_case(name: str) -> str:
    """'cHINese' -> 'Chinese': first letter upper, the rest lower (the model's spelling)."""
    name = name.strip()
    return name[:1].upper() + name[1:].lower()


def normalize_language(name: str) -> str:
    """The canonical spelling of a supported language ('english', 'ENGLISH ' -> 'English').

    Raises UnsupportedLanguageError (a ValueError) naming the supported languages for anything else.
    """
    if name is None or not str(name).strip():
        raise UnsupportedLanguageError("language is empty: pass None to let the model detect the language")
    canonical = _canonical_case(str(name))
    if canonical not in SUPPORTED_LANGUAGES:
        raise UnsupportedLanguageError(
            f"unsupported language {name!r}; supported languages: {', '.join(SUPPORTED_LANGUAGES)}"
        )
    return canonical


@dataclass(frozen=True)
class Prompt:
    """One request's decoder input, cut where the audio goes so the engine can place embeddings and reuse prefixes."""

    prefix_ids: tuple[int, ...]  # system turn + user turn up to and including <|audio_start|>
    num_audio_tokens: int  # <|audio_pad|> positions, one per audio encoder output token
    suffix_ids: tuple[int, ...]  # <|audio_end|> onwards: chat tail, forced-language tag, answer prefix
    audio_pad_id: int
    language: str | None = None  # the forced language (canonical), None when the model detects it
    answer_ids: tuple[int, ...] = ()  # tokens the answer was forced to start with (streaming partials); the tail
    # of suffix_ids

    @property
    def audio_offset(self) -> int:
        """Index of the first audio position in `input_ids`."""
        return len(self.prefix_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prefix_ids) + self.num_audio_tokens + len(self.suffix_ids)

    @property
    def input_ids(self) -> list[int]:
        """The full prompt, <|audio_pad|> repeated `num_audio_tokens` times."""
        return [*self.prefix_ids, *([self.audio_pad_id] * self.num_audio_tokens), *self.suffix_ids]


def build_prompt(
    tok: Tokenizer,
    *,
    context: str = "",
    language: str | None = None,
    num_audio_tokens: int,
    answer_ids: tuple[int, ...] = (),
) -> Prompt:
    """The prompt for one clip, token for token what the official processor produces.

    context: free text for the system turn (names, terms, previous sentences); may be empty.
    language: force the output language (any case of a supported name); None or blank lets the model detect it.
    num_audio_tokens: audio encoder output tokens for the clip.
    answer_ids: token ids the answer must continue, e.g. the previous partial's answer minus its last tokens
        (streaming partials); they follow the forced-language tag, like the official streaming prompt's text prefix,
        but as ids: the model's own tokens go back in without a detokenize/retokenize round trip.
    """
    _check_num_audio_tokens(num_audio_tokens)
    context = context or ""
    # The official processor expands the first <|audio_pad|> in the text: one inside the context would take the
    # audio's place, so refuse it rather than build a prompt that means something else.
    if tok.audio_token in context:
        raise ValueError(f"context must not contain the audio placeholder token {tok.audio_token!r}")
    forced = normalize_language(language) if language is not None and str(language).strip() else None

    # Added tokens cut the text into independently tokenized pieces, so cutting at <|audio_start|> / <|audio_end|>
    # gives the same ids as tokenizing the whole rendered prompt at once.
    prefix_text = f"{IM_START}system\n{context}{IM_END}\n{IM_START}user\n{tok.audio_start_token}"
    answer_start = f"{LANGUAGE_TAG}{forced}{ASR_TEXT}" if forced else ""
    suffix_text = f"{tok.audio_end_token}{IM_END}\n{IM_START}assistant\n{answer_start}"
    prefix_ids, suffix_ids = tok.encode(prefix_text), tok.encode(suffix_text)
    if prefix_ids[-1] != tok.audio_start_id or suffix_ids[0] != tok.audio_end_id:
        raise ValueError("the tokenizer does not keep the audio start/end tokens whole; check tokenizer_config.json")
    return Prompt(
        prefix_ids=tuple(prefix_ids),
        num_audio_tokens=num_audio_tokens,
        suffix_ids=(*suffix_ids, *answer_ids),
        audio_pad_id=tok.audio_pad_id,
        language=forced,
        answer_ids=tuple(answer_ids),
    )


def _check_num_audio_tokens(num_audio_tokens) -> None:
    if isinstance(num_audio_tokens, bool) or not isinstance(num_audio_tokens, int) or num_audio_tokens < 0:
        raise ValueError(f"num_audio_tokens must be a non-negative int, got {num_audio_tokens!r}")


class PromptTemplates:
    """`build_prompt` with the tokenized text around the audio kept per (context, language), least recently used
    dropped past `maxsize`: an engine admits every stream's partials with the same few contexts, and tokenizing the
    template for each admission was ~3% of the engine thread at 1000 streams (py-spy, H200). The prompts are those
    of build_prompt, id for id (only the audio count and the answer prefix vary per request). Thread-safe.
    `hits` and `misses` count the lookups."""

    def __init__(self, tok: Tokenizer, maxsize: int = 1024):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.tok = tok
        self._pieces = functools.lru_cache(maxsize=maxsize)(self._tokenize)  # a lookup that raises keeps nothing

    def _tokenize(self, context: str, language: str | None) -> tuple[tuple[int, ...], tuple[int, ...], str | None]:
        bare = build_prompt(self.tok, context=context, language=language, num_audio_tokens=0)
        return bare.prefix_ids, bare.suffix_ids, bare.language

    def __len__(self) -> int:
        return self._pieces.cache_info().currsize

    @property
    def hits(self) -> int:
        return self._pieces.cache_info().hits

    @property
    def misses(self) -> int:
        return self._pieces.cache_info().misses

    def build(self, *, context: str = "", language: str | None = None, num_audio_tokens: int,
              answer_ids: tuple[int, ...] = ()) -> Prompt:
        """As build_prompt (the same errors: a bad context or language is never kept)."""
        _check_num_audio_tokens(num_audio_tokens)
        prefix_ids, suffix_ids, forced = self._pieces(context or "", language)
        answer_ids = tuple(answer_ids)
        return Prompt(prefix_ids=prefix_ids, num_audio_tokens=num_audio_tokens, suffix_ids=suffix_ids + answer_ids,
                      audio_pad_id=self.tok.audio_pad_id, language=forced, answer_ids=answer_ids)


def parse_output(raw: str, forced_language: str | None = None) -> tuple[str, str]:
    """(language, text) from the decoded answer, with the official semantics.

    - forced_language given: the answer is plain text; it is returned with that language.
    - "language X<asr_text>TEXT" -> ("X", "TEXT") (X in canonical case); a "language None" tag -> ("", TEXT), i.e.
      ("", "") for silence.
    - no <asr_text> tag: the whole answer is text, language unknown ("").
    Runaway repetitions are collapsed first (collapse_repetitions).
    """
    text = (raw or "").strip()
    if not text:
        return "", ""
    text = collapse_repetitions(text)
    if forced_language:
        return forced_language, text
    if ASR_TEXT not in text:
        return "", text.strip()
    meta, text = text.split(ASR_TEXT, 1)
    text = text.strip()
    if f"{LANGUAGE_TAG}none" in meta.lower():
        return "", text
    for line in meta.splitlines():
        line = line.strip()
        if line.lower().startswith(LANGUAGE_TAG):
            name = line[len(LANGUAGE_TAG) :].strip()
            return (_canonical_case(name) if name else ""), text
    return "", text


def collapse_repetitions(text: str, threshold: int = REPETITION_THRESHOLD, max_pattern_chars: int = 20) -> str:
    """Guard against a decoder stuck in a loop: keep one copy of each runaway repetition.

    A character repeated more than `threshold` times in a row becomes one character; then, scanning left to right,
    the first pattern of 1..max_pattern_chars characters found repeated `threshold` or more times back to back
    becomes one copy, and the scan goes on after the run. Like the official guard, a pattern run is only looked for
    where it starts at least 2 * threshold characters before the end of the text.
    """
    text = re.sub(r"(.)\1{%d,}" % threshold, r"\1", text, flags=re.DOTALL)
    pieces = []
    start = 0  # text[start:] is still to be scanned
    while (run := _first_repeated_pattern(text, start, threshold, max_pattern_chars)) is not None:
        begin, pattern, end = run
        pieces.append(text[start:begin] + pattern)
        start = end
    pieces.append(text[start:])
    return "".join(pieces)


def _first_repeated_pattern(
    text: str, start: int, threshold: int, max_pattern_chars: int
) -> tuple[int, str, int] | None:
    """(begin, pattern, end) of the first pattern at or after `start` repeated >= threshold times, or None."""
    for begin in range(start, len(text) - 2 * threshold + 1):
        for size in range(1, max_pattern_chars + 1):
            end = begin + size * threshold
            if end > len(text):
                break
            pattern = text[begin : begin + size]
            if text.startswith(pattern, begin + size) and text[begin:end] == pattern * threshold:
                while text.startswith(pattern, end):
                    end += size
                return begin, pattern, end
    return None
