"""PromptTemplates: build_prompt's prompts, id for id, with the template tokenized once per (context, language)
(counted: the tokenizer's encode calls), least recently used dropped past its size, bad input refused as before."""

import pytest

from qasr.model.prompt import PromptTemplates, UnsupportedLanguageError, build_prompt
from qasr.model.tokenizer import Tokenizer


class Counting:
    """The tokenizer, counting encode calls."""

    def __init__(self, tok: Tokenizer):
        self._tok, self.encodes = tok, 0

    def encode(self, text):
        self.encodes += 1
        return self._tok.encode(text)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


CONTEXTS = ["", "hi", "Names: Zoë, 北京, O'Brien.\nSecond line", " leading and trailing "]
LANGUAGES = [None, "English", "chinese", "  "]


def test_the_prompts_are_build_prompts_id_for_id(tok):
    templates = PromptTemplates(tok)
    answers = [(), (1, 2, 3), tuple(tok.encode("language English<asr_text>Hello wor"))]
    for _ in range(2):  # the second round from the cache
        for context in CONTEXTS:
            for language in LANGUAGES:
                for num_audio in (0, 1, 13, 390):
                    for answer_ids in answers:
                        expected = build_prompt(tok, context=context, language=language, num_audio_tokens=num_audio,
                                                answer_ids=answer_ids)
                        got = templates.build(context=context, language=language, num_audio_tokens=num_audio,
                                              answer_ids=answer_ids)
                        assert got == expected and got.input_ids == expected.input_ids
    assert templates.misses == len(CONTEXTS) * len(LANGUAGES)
    assert templates.hits == 2 * len(CONTEXTS) * len(LANGUAGES) * 4 * len(answers) - templates.misses


def test_the_template_is_tokenized_once_per_context_and_language(tok):
    counting = Counting(tok)
    templates = PromptTemplates(counting)
    for i in range(100):  # 100 admissions of one stream's partials, answers growing
        templates.build(context="meeting about qasr", language=None, num_audio_tokens=13 * i, answer_ids=(7,) * i)
    assert counting.encodes == 2  # the text before the audio and the text after it, once
    templates.build(context="meeting about qasr", language="English", num_audio_tokens=5)
    assert counting.encodes == 4
    uncached = Counting(tok)
    for i in range(100):
        build_prompt(uncached, context="meeting about qasr", num_audio_tokens=13 * i, answer_ids=(7,) * i)
    assert uncached.encodes == 200  # what each admission cost before


def test_least_recently_used_contexts_are_dropped(tok):
    counting = Counting(tok)
    templates = PromptTemplates(counting, maxsize=2)
    for context in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" arrives
        templates.build(context=context, num_audio_tokens=1)
    assert len(templates) == 2 and counting.encodes == 6
    templates.build(context="a", num_audio_tokens=1)
    assert counting.encodes == 6
    templates.build(context="b", num_audio_tokens=1)
    assert counting.encodes == 8


def test_bad_input_is_refused_as_by_build_prompt_and_never_kept(tok):
    templates = PromptTemplates(tok)
    with pytest.raises(ValueError, match="num_audio_tokens"):
        templates.build(num_audio_tokens=-1)
    with pytest.raises(UnsupportedLanguageError, match="Klingon"):
        templates.build(language="Klingon", num_audio_tokens=3)
    with pytest.raises(ValueError, match="audio placeholder"):
        templates.build(context="see <|audio_pad|>", num_audio_tokens=3)
    assert len(templates) == 0
    with pytest.raises(ValueError, match="maxsize"):
        PromptTemplates(tok, maxsize=0)
