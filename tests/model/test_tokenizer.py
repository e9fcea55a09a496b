"""qasr.model.tokenizer and qasr.model.prompt against the official processor, tokenizer and output parsing."""

import dataclasses
import json
import random
import shutil

import pytest

from qasr.model.prompt import (
    SUPPORTED_LANGUAGES,
    Prompt,
    UnsupportedLanguageError,
    build_prompt,
    collapse_repetitions,
    normalize_language,
    parse_output,
)
from qasr.model.tokenizer import OFFICIAL_EOS_IDS, Tokenizer, TokenizerFilesError

official = pytest.importorskip("official", reason="tests/official.py needs transformers and qwen-asr")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def processor(tiny_model_dir):
    official.import_official()
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_model_dir), fix_mistral_regex=True)


@pytest.fixture(scope="module")
def official_utils():
    official.import_official()
    from qwen_asr.inference import utils

    return utils


CONTEXTS = [
    "",
    "Meeting about the quarterly budget. Speakers: Anna, Bob.",
    "会议讨论明年的预算。",
    "line one\n\nline two\ttabbed & 'quoted' \"double\" {braces} 100% <b>html</b>",
    "  leading and trailing spaces  ",
    "\n",
    "Names: O'Brien, McDonald's, café, naïve, Grüße, ñandú 🙂",
    "a context that mentions <|im_end|> and <asr_text> literally",
]
LANGUAGES = [None, "English", "chinese"]
NUM_SAMPLES = [8000, 2 * 16000 + 123, 7 * 16000 + 50]


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------


def test_named_ids_are_the_real_ones(tok):
    assert (tok.im_start_id, tok.im_end_id, tok.endoftext_id) == (151644, 151645, 151643)
    assert (tok.audio_start_id, tok.audio_end_id, tok.audio_pad_id) == (151669, 151670, 151676)
    assert tok.asr_text_id == 151704
    assert tok.eos_ids == OFFICIAL_EOS_IDS == (151645, 151643)
    assert tok.vocab_size == 151705
    assert tok.token_id("<|audio_pad|>") == 151676
    with pytest.raises(ValueError, match="not in the tokenizer"):
        tok.token_id("<|no_such_token|>")


ENCODE_TEXTS = [
    "Hello world, this is a test.",
    "It's they'll we've I'M DON'T",
    "Numbers 12345 and 3.14159, dates 2024-05-17!!!",
    "multi\n\n\nline\r\n  indented\t\ttabs   end  ",
    "今天天气很好，我们去公园散步吧。龘",
    "こんにちは、안녕하세요, Привет, مرحبا, नमस्ते, สวัสดี",
    "emoji 🙂🎉 and combining e\u0301 (NFC makes it é)",
    "<|im_start|>system\nctx<|im_end|>\nlanguage English<asr_text>text",
    "CamelCaseWords and snake_case_words/with/slashes",
]


@pytest.mark.parametrize("text", ENCODE_TEXTS)
def test_encode_and_decode_match_the_official_tokenizer(tok, processor, text):
    ids = tok.encode(text)
    assert ids == processor.tokenizer.encode(text)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == processor.tokenizer.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )


@pytest.mark.parametrize("text", [t for t in ENCODE_TEXTS if "\u0301" not in t])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_decode_keeps_asr_text_and_drops_special_tokens(tok):
    ids = [tok.im_start_id, *tok.encode("language English"), tok.asr_text_id, *tok.encode(" Hi there."), tok.im_end_id]
    assert tok.decode(ids) == "language English<asr_text> Hi there."
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>language English<asr_text> Hi there.<|im_end|>"


def test_every_id_decodes_to_text_and_ids_past_the_tokenizer_to_nothing(tok):
    sample = random.Random(0).sample(range(tok.vocab_size), 3000) + list(range(151643, 151705))
    assert all(tok.decode([i], skip_special_tokens=False) for i in sample)
    assert tok.id_to_token(151705) is None and tok.id_to_token(151935) is None


def test_tokenizer_json_is_used_when_present(tiny_model_dir, processor, tmp_path):
    shutil.copy(tiny_model_dir / "tokenizer_config.json", tmp_path)
    processor.tokenizer.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    from_json = Tokenizer.from_pretrained(tmp_path)  # no vocab.json / merges.txt here
    text = ENCODE_TEXTS[4] + ENCODE_TEXTS[7]
    assert from_json.encode(text) == processor.tokenizer.encode(text)
    assert from_json.asr_text_id == 151704


def _write_tiny_tokenizer(folder, added: dict) -> None:
    (folder / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    (folder / "merges.txt").write_text("#version: 0.2\na b\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))


def test_added_tokens_with_gaps_or_missing_files_are_clear_errors(tmp_path):
    spec = {"special": True, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    _write_tiny_tokenizer(tmp_path, {"3": {"content": "<|im_start|>", **spec}, "7": {"content": "<|im_end|>", **spec}})
    with pytest.raises(TokenizerFilesError, match="declared with id 7"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "merges.txt").unlink()
    with pytest.raises(TokenizerFilesError, match="merges.txt"):
        Tokenizer.from_pretrained(tmp_path)


def test_missing_prompt_tokens_are_a_clear_error(tmp_path):
    _write_tiny_tokenizer(tmp_path, {})
    with pytest.raises(TokenizerFilesError, match="<|im_start|>"):
        Tokenizer.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------------------
# Prompt
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_samples", NUM_SAMPLES)
@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("context", CONTEXTS)
def test_prompt_ids_match_the_official_processor(tok, processor, context, language, num_samples):
    expected = official.official_prompt_ids(processor, num_samples, context, language)
    num_audio = expected.count(tok.audio_pad_id)
    prompt = build_prompt(tok, context=context, language=language, num_audio_tokens=num_audio)
    assert prompt.input_ids == expected
    assert prompt.audio_offset == expected.index(tok.audio_pad_id)
    assert prompt.num_tokens == len(expected)


@pytest.mark.parametrize(
    ("language", "text_prefix"),
    [
        (None, "language English<asr_text>Hello wor"),
        (None, "language Chinese<asr_text>今天天气"),
        ("English", "Hello world, this is"),
        ("English", " leading space"),
        (None, "language English"),  # cut before the tag
    ],
)
def test_prompt_with_answer_ids_matches_the_official_streaming_prompt(tok, processor, language, text_prefix):
    """The official streaming appends its rolled-back text to the prompt string; the engine appends the tokens
    themselves: the same ids, since added tokens cut the prompt into independently tokenized pieces."""
    expected = official.official_prompt_ids(processor, 3 * 16000, "ctx", language, text_prefix=text_prefix)
    num_audio = expected.count(tok.audio_pad_id)
    answer_ids = tuple(tok.encode(text_prefix))
    prompt = build_prompt(tok, context="ctx", language=language, num_audio_tokens=num_audio, answer_ids=answer_ids)
    assert prompt.input_ids == expected
    assert prompt.answer_ids == answer_ids and prompt.suffix_ids[-len(answer_ids):] == answer_ids


def test_prompt_pieces(tok):
    prompt = build_prompt(tok, context="hi", language="ENGLISH", num_audio_tokens=5)
    assert prompt.prefix_ids[0] == tok.im_start_id and prompt.prefix_ids[-1] == tok.audio_start_id
    assert prompt.suffix_ids[0] == tok.audio_end_id and prompt.suffix_ids[-1] == tok.asr_text_id
    assert prompt.input_ids == [*prompt.prefix_ids, *[tok.audio_pad_id] * 5, *prompt.suffix_ids]
    assert prompt.audio_offset == len(prompt.prefix_ids)
    assert prompt.language == "English"
    assert tok.decode(prompt.suffix_ids, skip_special_tokens=False) == (
        "<|audio_end|><|im_end|>\n<|im_start|>assistant\nlanguage English<asr_text>"
    )
    # the same context gives the same prefix whatever the audio and language: the engine can cache it
    other = build_prompt(tok, context="hi", language=None, num_audio_tokens=99)
    assert other.prefix_ids == prompt.prefix_ids and other.language is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        prompt.num_audio_tokens = 3  # type: ignore[misc]
    assert isinstance(prompt, Prompt)


def test_build_prompt_rejects_bad_input(tok):
    with pytest.raises(ValueError, match="num_audio_tokens"):
        build_prompt(tok, num_audio_tokens=-1)
    with pytest.raises(UnsupportedLanguageError, match="Klingon.*supported languages: Chinese, English"):
        build_prompt(tok, language="Klingon", num_audio_tokens=3)
    with pytest.raises(ValueError, match="audio placeholder"):
        build_prompt(tok, context="see <|audio_pad|>", num_audio_tokens=3)
    assert build_prompt(tok, language="  ", num_audio_tokens=3).language is None  # blank = detect, as official


def test_language_names_follow_the_official_list_and_normalisation(official_utils):
    assert list(SUPPORTED_LANGUAGES) == official_utils.SUPPORTED_LANGUAGES
    for name in ("english", "ENGLISH", " cHINese ", "macedonian"):
        assert normalize_language(name) == official_utils.normalize_language_name(name)
    for bad in ("", "   ", None, "Klingon", "en"):
        with pytest.raises(ValueError):
            normalize_language(bad)


# ---------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------

PARSE_CASES = [
    ("language English<asr_text>Hello world.", None, ("English", "Hello world.")),
    ("language None<asr_text>", None, ("", "")),
    ("  language none<asr_text>  ", None, ("", "")),
    ("language None<asr_text>still text", None, ("", "still text")),
    ("language chinese\n<asr_text>你好", None, ("Chinese", "你好")),
    ("some preamble\nlanguage German<asr_text> Guten Tag ", None, ("German", "Guten Tag")),
    ("<asr_text>no language", None, ("", "no language")),
    ("Plain text without a tag", None, ("", "Plain text without a tag")),
    ("Forced text", "English", ("English", "Forced text")),
    ("language English<asr_text>" + "ha" * 50, None, ("English", "ha")),
    ("", None, ("", "")),
    ("   ", "English", ("", "")),
    ("language French<asr_text>" + "a" * 30 + " fin", None, ("French", "a fin")),
]


@pytest.mark.parametrize(("raw", "forced", "expected"), PARSE_CASES)
def test_parse_output(official_utils, raw, forced, expected):
    assert parse_output(raw, forced_language=forced) == expected
    assert official_utils.parse_asr_output(raw, user_language=forced) == expected


def test_collapse_repetitions_behaves_like_the_official_guard(official_utils):
    rng = random.Random(0)
    for _ in range(400):
        pieces = []
        for _ in range(rng.randint(0, 8)):
            unit = "".join(rng.choice("ab c你") for _ in range(rng.randint(1, 4)))
            pieces.append(unit * rng.choice([1, 2, 5, 19, 20, 21, 40]))
        text = "".join(pieces)
        assert collapse_repetitions(text) == official_utils.detect_and_fix_repetitions(text), text
    assert collapse_repetitions("ab" * 25 + "x") == "abx"
    assert collapse_repetitions("short text") == "short text"
